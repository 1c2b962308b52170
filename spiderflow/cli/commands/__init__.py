"""One module per command group; each defines ``register(subparsers)`` and is discovered automatically."""
