# Diagnostic kept with its output (run from the repository root; FIXED=1 uses vLLM 0.34's copy, VARIANT=default the
# whole default checkpoint): python3 results/cpu-2026-12-07-partial-hit-size/cow_probe.py
import json, os, sys
sys.path[:0] = ["tests/model", "tests/gpu"]
from model_helpers import CPU_ENGINE_ENV
os.environ.update(CPU_ENGINE_ENV); os.environ["VLLM_LING_KDA_PREFILL_CHECKPOINT"] = "0"
from pathlib import Path
import torch
import vllm.v1.worker.gpu_model_runner as gmr
import vllm.v1.worker.utils as wu
orig = wu.copy_kv_cache_blocks_inplace
sys.path.insert(0, 'results/cpu-2026-12-07-partial-hit-size')
from copy_fixed import copy_fixed as FIX
LOG = []
def logged(kv_caches, num_blocks, copies):
    kv = list(kv_caches)
    shapes = sorted({(tuple(c.shape), c.dtype.__repr__()) for c in kv})
    paths = []
    for c in kv:
        st = c.untyped_storage(); stride = c.stride(0) * c.element_size() * (c.shape[0] // num_blocks)
        paths.append("storage" if st.nbytes() == num_blocks * stride else "unflatten")
    LOG.append({"copies": [tuple(x) for x in copies], "num_blocks": num_blocks, "shapes": [str(s) for s in shapes],
                "paths": sorted(set(paths)), "n_caches": len(kv)})
    return FIX(kv, num_blocks, copies) if os.environ.get('FIXED') else orig(kv, num_blocks, copies)
gmr.copy_kv_cache_blocks_inplace = logged
import vllm.v1.core.single_type_kv_cache_manager as st
COW = []
orig_cow = st.SingleTypeKVCacheManager._apply_cow
def cow(self, request_id, block_idx, source_block, cow_block):
    COW.append((type(self).__name__, getattr(self, "kv_cache_group_id", None), self.block_size, request_id[-6:], block_idx,
                source_block.block_id, cow_block.block_id))
    return orig_cow(self, request_id, block_idx, source_block, cow_block)
st.SingleTypeKVCacheManager._apply_cow = cow
for name in dir(st):
    c = getattr(st, name)
    if isinstance(c, type) and issubclass(c, st.SingleTypeKVCacheManager) and "_apply_cow" in c.__dict__:
        print("OVERRIDE", name)
import engine_runner
from ling_tools.tiny import ensure_tiny
from test_prefix_cache_engine import _spec, _chain_rounds, _silenced, PARTIAL_GRAIN
import partial_hit_size, shutil
out = Path("/tmp/cow/mla"); shutil.rmtree(out, ignore_errors=True)
model = _silenced(ensure_tiny(variant="stable_router"), out, mla=False) if os.environ.get("VARIANT") is None else ensure_tiny(variant=os.environ["VARIANT"])
spec = _spec(str(model), _chain_rounds(), engine_kwargs={"prefix_match_unit": PARTIAL_GRAIN})
res = engine_runner.run(spec)
print("COPIES", json.dumps(LOG)[:600])
print("COW", COW)
print("PARTINGS", json.dumps(partial_hit_size.partings(res)))
print("BLOCK", res.get("block_size"), res.get("num_blocks"))
os._exit(0)
