"""The demo modules for ``lightning.pytorch`` (``import lightning as L``): the same bodies, other bases.

``lightning-gradacc --namespace lightning`` (or a config naming ``lightning.pytorch`` classes) resolves the
configs' short class names (``ClassifierModule``, ...) to these.
"""

from __future__ import annotations

import lightning.pytorch as L

from .char_lm import _CharLM, _CharTextData
from .classifier import _BlobsData, _Classifier


class BlobsDataModule(_BlobsData, L.LightningDataModule):  # type: ignore[misc]  # noqa: D101
    __doc__ = _BlobsData.__doc__


class ClassifierModule(_Classifier, L.LightningModule):  # type: ignore[misc]  # noqa: D101
    __doc__ = _Classifier.__doc__


class CharTextDataModule(_CharTextData, L.LightningDataModule):  # type: ignore[misc]  # noqa: D101
    __doc__ = _CharTextData.__doc__


class CharLMModule(_CharLM, L.LightningModule):  # type: ignore[misc]  # noqa: D101
    __doc__ = _CharLM.__doc__


__all__ = ["BlobsDataModule", "CharLMModule", "CharTextDataModule", "ClassifierModule"]
