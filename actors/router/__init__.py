"""The router in front of data-parallel replicas (``--dp-size``), owned by the tokenizer:
``policies`` (which replica takes a request; the ``ROUTER_POLICIES`` registry) over
``core`` (each replica's load and cached blocks, learnt from its cache manager)."""

__all__: list[str] = []
