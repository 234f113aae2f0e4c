"""``python -m lightning_gradacc``: the same as the ``lightning-gradacc`` command."""

from lightning_gradacc.cli import main

if __name__ == "__main__":
    main()
