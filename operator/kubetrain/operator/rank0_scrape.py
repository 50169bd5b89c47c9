"""Reading rank 0's /metrics: the one network read of a reconcile pass besides the indexes.

The resync asks for it once per `resync_seconds` for each job that runs kubetrain's trainer
(`TrainingJobController`); the text is parsed by `kubetrain.operator.facts.metrics_sample`
into the progress reconcile reads. A rank 0 that is not up, or does not answer within
the timeout, gives no sample: the pass goes on without one.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterable

from kubetrain.operator.facts import MetricsSample, WorkerPod, metrics_sample

log = logging.getLogger(__name__)


def scrape_rank0(pods: Iterable[WorkerPod], port: int,
                 timeout_seconds: float) -> MetricsSample | None:
    """Rank 0's training metrics, or None when it is not up or not answering."""
    rank0 = next((pod for pod in pods
                  if pod.index == 0 and pod.phase == "Running" and pod.ip), None)
    if rank0 is None:
        return None
    url = f"http://{rank0.ip}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_seconds) as reply:
            return metrics_sample(reply.read().decode())
    except (OSError, ValueError) as error:
        log.info("no metrics from %s: %s", url, error)
        return None
