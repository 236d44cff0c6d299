"""The actors: the framework (``runtime``), one folder per role with its actor shell
beside its pure core (``tokenizer``, ``scheduler``, ``cache``, ``worker``), the client
end of the pipeline (``client``) and the registration of the built-in roles (``roles``)."""
