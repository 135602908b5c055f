"""A stand-in for the flashinfer package (0.6.0) that computes in torch what its kernels compute, so the flashinfer
backend's planning and plumbing run on any machine; the real kernels are tested on a GPU.

It keeps the parts of FlashInfer's contract the backend leans on, as read in the 0.6.0 source: paged KV as
(k_cache, v_cache) of [pages, page_size, kv_heads, head_dim] (NHD); int32 CSR plans; a prefill query row's causal
and window masks aligned bottom-right, kv_idx + qo_len <= kv_len + qo_idx and
kv_idx + qo_len + window_left >= kv_len + qo_idx (include/flashinfer/attention/variants.cuh); q and KV dtypes
fixed by the plan (utils._check_cached_qkv_data_type); in CUDA-graph mode a decode wrapper's batch size fixed by
its buffers, plan copying into them and the kernels reading only them. Every call is recorded, so a test can bind
each one to the real package's signatures where flashinfer is installed.
"""

from __future__ import annotations

import importlib.machinery
import types

import torch


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []  # (qualified name, args, kwargs)

    def record(self, name: str, args: tuple, kwargs: dict) -> None:
        self.calls.append((name, args, kwargs))


def attend(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], qo_indptr: torch.Tensor,
           kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor, causal: bool,
           window_left: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: its query rows over its pages, in float32. Returns (out in q's dtype, lse [rows, heads])."""
    k_cache, v_cache = kv
    assert k_cache.dim() == 4, "paged KV is 4-D NHD: [pages, page_size, kv_heads, head_dim]"
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:2], float("-inf"))
    for b in range(len(last_page_len)):
        rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long().cpu()
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()
        slots = slots[: (len(pages) - 1) * page_size + int(last_page_len[b])]
        keys = k_cache.flatten(0, 1)[slots].float().cpu().repeat_interleave(group, 1)
        values = v_cache.flatten(0, 1)[slots].float().cpu().repeat_interleave(group, 1)
        queries = q[rows].float().cpu()
        qo_len, kv_len = len(queries), len(slots)
        qo_idx, kv_idx = torch.arange(qo_len)[:, None], torch.arange(kv_len)[None, :]
        keep = torch.ones(qo_len, kv_len, dtype=torch.bool)
        if causal:
            keep &= kv_idx + qo_len <= kv_len + qo_idx
        if window_left >= 0:
            keep &= kv_idx + qo_len + window_left >= kv_len + qo_idx
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * sm_scale
        scores = scores.masked_fill(~keep, float("-inf"))
        row_lse = torch.logsumexp(scores, -1)  # [heads, queries]
        out[rows] = torch.einsum("hqk,khd->qhd", torch.exp(scores - row_lse[..., None]), values)
        lse[rows] = row_lse.T
    return out.to(q.dtype).to(q.device), lse.to(q.device)


def _check_types(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], q_data_type, kv_data_type) -> None:
    if q.dtype != q_data_type:
        raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {q_data_type}")
    if kv[0].dtype != (kv_data_type or q_data_type):
        raise ValueError(f"The dtype of k {kv[0].dtype} does not match the kv_data_type {kv_data_type}")


def _check_plan(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor,
                page_size: int) -> None:
    assert {kv_indptr.dtype, kv_indices.dtype, last_page_len.dtype} == {torch.int32}
    assert len(kv_indptr) == len(last_page_len) + 1 and int(kv_indptr[-1]) == len(kv_indices)
    assert bool(((last_page_len >= 1) & (last_page_len <= page_size)).all())


def make_module(recorder: Recorder) -> types.ModuleType:
    """A module object with the names the backend imports from flashinfer."""

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, **kwargs):
            recorder.record("BatchPrefillWithPagedKVCacheWrapper.__init__", (float_workspace_buffer, kv_layout),
                            dict(use_cuda_graph=use_cuda_graph, **kwargs))
            assert kv_layout == "NHD" and not use_cuda_graph
            self.planned: dict | None = None

        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                 num_kv_heads, head_dim_qk, page_size, **kwargs):
            args = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                    num_kv_heads, head_dim_qk, page_size)
            recorder.record("BatchPrefillWithPagedKVCacheWrapper.plan", args, kwargs)
            _check_plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
            assert qo_indptr.dtype == torch.int32 and len(qo_indptr) == len(paged_kv_indptr)
            self.planned = dict(layout=(qo_indptr.clone(), paged_kv_indptr.clone(), paged_kv_indices.clone(),
                                        paged_kv_last_page_len.clone()),
                                heads=(num_qo_heads, num_kv_heads, head_dim_qk), causal=kwargs.get("causal", False),
                                window_left=kwargs.get("window_left", -1), sm_scale=kwargs["sm_scale"],
                                types=(kwargs.get("q_data_type"), kwargs.get("kv_data_type")))

        def run(self, q, paged_kv_cache, *args, return_lse=False, **kwargs):
            recorder.record("BatchPrefillWithPagedKVCacheWrapper.run", (q, paged_kv_cache, *args),
                            dict(return_lse=return_lse, **kwargs))
            plan = self.planned
            _check_types(q, paged_kv_cache, *plan["types"])
            assert q.shape[0] == int(plan["layout"][0][-1]) and tuple(q.shape[1:]) == (plan["heads"][0],
                                                                                        plan["heads"][2])
            out, lse = attend(q, paged_kv_cache, *plan["layout"], plan["causal"], plan["window_left"],
                              plan["sm_scale"])
            return (out, lse) if return_lse else out

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                     paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                     **kwargs):
            recorder.record("BatchDecodeWithPagedKVCacheWrapper.__init__", (float_workspace_buffer, kv_layout),
                            dict(use_cuda_graph=use_cuda_graph, use_tensor_cores=use_tensor_cores,
                                 paged_kv_indptr_buffer=paged_kv_indptr_buffer,
                                 paged_kv_indices_buffer=paged_kv_indices_buffer,
                                 paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer, **kwargs))
            assert kv_layout == "NHD"
            self.use_cuda_graph = use_cuda_graph
            self.use_tensor_cores = use_tensor_cores
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            if use_cuda_graph:
                assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.planned: dict | None = None

        def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs):
            args = (indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size)
            recorder.record("BatchDecodeWithPagedKVCacheWrapper.plan", args, kwargs)
            _check_plan(indptr, indices, last_page_len, page_size)
            group = num_qo_heads // num_kv_heads
            assert self.use_tensor_cores or group in (1, 2, 3, 4, 8), "CUDA-core decode: unsupported group size"
            if self.use_cuda_graph:
                indptr_buf, indices_buf, last_buf = self.buffers
                if len(last_page_len) != len(last_buf):
                    raise ValueError("The batch size should be fixed in cudagraph mode")
                if len(indices) > len(indices_buf):
                    raise ValueError("The size of indices should be less than or equal to the allocated buffer")
                indptr_buf.copy_(indptr)
                last_buf.copy_(last_page_len)
                indices_buf[: len(indices)].copy_(indices)
                layout = self.buffers
            else:
                layout = (indptr.clone(), indices.clone(), last_page_len.clone())
            self.planned = dict(layout=layout, heads=(num_qo_heads, num_kv_heads, head_dim),
                                window_left=kwargs.get("window_left", -1), sm_scale=kwargs["sm_scale"],
                                types=(kwargs.get("q_data_type"), kwargs.get("kv_data_type")))

        def run(self, q, paged_kv_cache, *args, return_lse=False, **kwargs):
            recorder.record("BatchDecodeWithPagedKVCacheWrapper.run", (q, paged_kv_cache, *args),
                            dict(return_lse=return_lse, **kwargs))
            plan = self.planned
            _check_types(q, paged_kv_cache, *plan["types"])
            indptr, indices, last_page_len = plan["layout"]
            assert q.shape[0] == len(last_page_len)
            qo_indptr = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
            out, lse = attend(q, paged_kv_cache, qo_indptr, indptr, indices, last_page_len, False,
                              plan["window_left"], plan["sm_scale"])
            return (out, lse) if return_lse else out

    def merge_state_in_place(v, s, v_other, s_other, mask=None):
        recorder.record("merge_state_in_place", (v, s, v_other, s_other), dict(mask=mask))
        top = torch.maximum(s, s_other)
        weight, weight_other = torch.exp(s - top)[..., None], torch.exp(s_other - top)[..., None]
        v.copy_((v.float() * weight + v_other.float() * weight_other) / (weight + weight_other))
        s.copy_(top + torch.log(weight + weight_other)[..., 0])

    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)  # find_spec() answers for it as installed
    module.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    module.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    module.merge_state_in_place = merge_state_in_place
    return module
