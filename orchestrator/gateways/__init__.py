"""The gateway in front of the servers: one adapter per kind of gateway and the client that runs
them through the agent."""
