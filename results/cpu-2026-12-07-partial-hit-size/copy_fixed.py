# vLLM 0.34.0 copy_kv_cache_blocks_inplace (vllm/v1/worker/utils.py), its dedup keyed on view geometry; for cow_probe.py
# 0.34's geometry-keyed copy, backported for the experiment
import numpy as np, torch
from vllm.utils.torch_utils import async_tensor_h2d
def copy_fixed(kv_caches, num_blocks, kv_cache_block_copies):
    if not kv_cache_block_copies:
        return
    indices_np = np.array(kv_cache_block_copies, dtype=np.int64)
    indices = None; seen = set(); copied_storages = set()
    for cache in kv_caches:
        key = (cache.device, cache.data_ptr(), tuple(cache.shape), tuple(cache.stride()), cache.element_size())
        if key in seen:
            continue
        seen.add(key)
        if indices is None:
            indices = async_tensor_h2d(indices_np, device=cache.device)
        src, dst = indices.unbind(dim=1)
        kernel_blocks_per_block, remainder = divmod(cache.shape[0], num_blocks)
        assert remainder == 0
        storage = cache.untyped_storage()
        storage_key = (cache.device, storage.data_ptr())
        stride = cache.stride(0) * cache.element_size() * kernel_blocks_per_block
        if storage.nbytes() == num_blocks * stride:
            if storage_key in copied_storages:
                continue
            copied_storages.add(storage_key)
            blocks = torch.empty(0, dtype=torch.uint8, device=cache.device)
            blocks.set_(storage)
            blocks = blocks.view(num_blocks, -1)
        else:
            blocks = cache.unflatten(0, (num_blocks, kernel_blocks_per_block))
        blocks[dst] = blocks[src]
