"""The core is torch only: importing it imports no Lightning."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_core_imports_without_lightning() -> None:
    code = textwrap.dedent(
        """
        import sys
        import lightning_gradacc.core
        from lightning_gradacc import GradAccumulator, AccumulationStats
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('pytorch_lightning', 'lightning'))
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)
