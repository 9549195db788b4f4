"""The controller's half of the agent contract: every op as a value with the reader of its answer
(``protocol``, one row per op in ``OPS``) and the client that frames batches over a connector
(``client``)."""
