"""crashproof inside the frameworks people train with.

One module per framework, each importing its framework only when used:

- :mod:`crashproof.integrations.transformers`: a Hugging Face ``Trainer`` callback;
- :mod:`crashproof.integrations.lightning`: a Lightning callback;
- :mod:`crashproof.integrations.dcp`: a ``torch.distributed.checkpoint`` storage writer and
  reader pair that writes and reads crashproof's verified format.

Nothing here is imported by ``import crashproof``: a missing framework costs nothing until its
integration is used, and then fails naming the extra that installs it.
"""
