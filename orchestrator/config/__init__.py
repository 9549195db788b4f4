"""Typed inputs with located errors: YAML with lines, the playbook, the inventory and its edits,
model config files and the files the tool writes where a person says. Nothing here reaches a host."""
