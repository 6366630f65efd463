"""``python -m lightning_pgc``: the same CLI as the ``lightning-pgc`` console script (see :mod:`lightning_pgc.cli`)."""

from lightning_pgc.cli import main

if __name__ == "__main__":
    main()
