"""dalle.plan: dalle-plan's capacity plan, as a dict."""
import json

from . import _dalle
from ._config import assignments


def plan(config=None, *, nodes=1, gpus_per_node=8, gpu_memory=80, peak_tflops=None, mfu=None,
         link_within_gbps=None, link_across_gbps=None, batch=None, overrides=None):
    """The capacity plan of a dalle-train prior recipe (a YAML file; None: DALL-E 12B's defaults)
    on `nodes` machines of `gpus_per_node` GPUs of `gpu_memory` GiB: memory per rank and whether
    it fits, bytes per update, FLOPs and a predicted step time, as `dalle-plan --json` prints it.
    The other keywords are dalle-plan's options (None: its defaults); overrides set recipe keys."""
    cluster = _dalle.ClusterShape()
    cluster.nodes, cluster.gpus_per_node, cluster.gpu_memory_gib = nodes, gpus_per_node, float(gpu_memory)
    for name, value in (("peak_tflops", peak_tflops), ("mfu", mfu), ("link_within_gbps", link_within_gbps),
                        ("link_across_gbps", link_across_gbps)):
        if value is not None:
            setattr(cluster, name, float(value))
    overrides = dict(overrides or {})
    if batch is not None:
        overrides["data.batch_size"] = batch
    return json.loads(_dalle.plan("" if config is None else str(config), assignments(overrides), cluster))
