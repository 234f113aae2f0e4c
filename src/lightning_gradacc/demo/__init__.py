"""Small, self-contained experiments for the YAML configs the package ships (``configs/``).

All data ships with the package or is generated deterministically; nothing is downloaded.
"""

from .char_lm import CharLMModule, CharTextDataModule
from .classifier import BlobsDataModule, ClassifierModule

__all__ = ["BlobsDataModule", "CharLMModule", "CharTextDataModule", "ClassifierModule"]
