"""The connect gate proves we talk to the right host.

Strict host keys, through the GPU host when `jump`.
"""
