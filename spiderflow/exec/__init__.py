"""Real execution of plans with ``torch.distributed`` (gloo): model, data, pipeline executor, checkpoints.

:mod:`spiderflow.exec.spec` is torch-free (agents build specs with it); :mod:`~spiderflow.exec.runtime`,
:mod:`~spiderflow.exec.model`, :mod:`~spiderflow.exec.checkpoint` import torch. Workers run as
``python -m spiderflow.exec.worker --spec FILE.json``.
"""

__all__: list[str] = []
