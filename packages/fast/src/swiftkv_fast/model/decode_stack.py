"""A run of the model's layers over decode rows as one C call (kernels/cpu_decode_stack.py), where it
applies; the model (model/swiftkv_model.py) runs its layers one op at a time everywhere else.

It applies on CPU in fp32 without tensor parallelism, with the torch attention backend's compiled decode
path, to a batch whose every row is one request's one token (the second half always; the first half in
a step of decodes only). Where the linear kernels are chosen by measurement, every linear keeps a
panel GEMM layout and worker/stack_timing.py times the stack against the per-op path at each decode
row bucket on this machine (`decide`): the stack runs where it was faster, whatever each linear's
own fastest kernel is (the stack can win a step while a library wins each linear timed alone: it
saves the per-op calls between them). Where a kernel is forced, the stack runs at a row count when
the panel GEMM runs every linear of the run there (`runs_at`, looked up once per row count). Its
result is then the per-op path's bit for bit (h with the last layer's MLP output added); where the
per-op path runs another kernel, the two differ by fp32 reassociation.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from swiftkv_fast.kernels import build, cpu_decode
from swiftkv_fast.kernels import cpu_decode_stack as kernel_module
from swiftkv_fast.kernels.cpu_decode_stack import StackGroup, StackLayer, StackLinear, StackStep
from swiftkv_fast.kernels.cpu_gemm import FORMATS, PanelWeight
from swiftkv_fast.model.layers import Linear, RotaryTable


class DecodeStack:
    """Layers `layers` (model/swiftkv_model.py LayerWeights) with `writes_kv` (the first half's: q, k and
    v from qkv, K/V written to the cache) or not (the second half's: q from q_proj_swiftkv)."""

    def __init__(
        self,
        layers: Sequence,
        *,
        kernel,
        writes_kv: bool,
        kv_slot: Sequence[int],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        rotary: RotaryTable,
        kv_dtype: torch.dtype = torch.float32,
    ):
        self.layers = list(layers)
        self.kv_dtype = kv_dtype  # the cache's: fp32 or bf16 (the kernel is built for one)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.scale, self.rotary = eps, scale, rotary
        self.writes_kv = writes_kv
        self.num_groups = 1 + max((lw.group for lw in self.layers), default=0)
        self._kv_slot = kv_slot
        self._runs_at: dict[int, bool] = {}
        self._decided: list[tuple[int, bool]] | None = None  # (max rows, runs) ascending (`decide`)
        self.calls = 0  # runs so far (tests, stats)
        # None, or (len(TIMED_PHASES),) float64 on CPU: each run adds the seconds of its GEMMs, attention
        # and RoPE + KV writes (kernels/cpu_decode_stack.py TIMED_PHASES; bench/step_profile.py sets it)
        self.timings: torch.Tensor | None = None
        self._kernel = kernel  # kernels/cpu_decode_stack.py `kernel(head_dim, group, kv_dtype)`, the plan's
        self._fn = self._structs = None  # the kernel and its layer table (`_build`)
        self._keep: list[torch.Tensor] = []  # the norms' and biases' own copies the table points at
        self.ready()  # built now where it can run, rather than at a first decode step

    def _build(self) -> bool:
        """Compile the kernel and fill the layer table (once); False where the kernel cannot serve."""
        if self._structs is None:
            group = self.num_heads // self.num_kv_heads
            shapes_ok = self.num_heads % self.num_kv_heads == 0
            shapes_ok = shapes_ok and cpu_decode.supports_shape(self.head_dim, group)
            shapes_ok = shapes_ok and build.kv_bf16(self.kv_dtype) is not None
            if not (self.layers and shapes_ok and all(self._fits(lw) for lw in self.layers)):
                return False
            self._fn = self._kernel
            self._structs = (StackLayer * len(self.layers))(
                *(self._layer(lw, self._kv_slot[lw.cache_layer]) for lw in self.layers)
            )
        return True

    def _fits(self, lw) -> bool:
        """The layer is what the C call computes: fp32 norms, and linears of the widths it reads and
        writes (qkv: q, or q + k + v where it writes the cache; the MLP: gate and up side by side)."""
        hidden, q_width = lw.input_norm.shape[0], self.num_heads * self.head_dim
        qkv = q_width + (2 * self.num_kv_heads * self.head_dim if self.writes_kv else 0)
        widths = [
            (lw.qkv.in_features, lw.qkv.out_features) == (hidden, qkv),
            (lw.o.in_features, lw.o.out_features) == (q_width, hidden),
            lw.gate_up.in_features == hidden and lw.gate_up.out_features == 2 * lw.down.in_features,
            lw.down.out_features == hidden,
        ]
        norms = all(
            t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() and t.shape == (hidden,)
            for t in (lw.input_norm, lw.post_norm)
        )
        return all(widths) and norms

    def _linear(self, lin: Linear) -> StackLinear:
        panel = stack_panel(lin)
        bias = None if lin.bias is None else self._own(lin.bias)
        return StackLinear(
            None if panel is None else panel.packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            lin.out_features,
            lin.in_features,
            0 if panel is None else FORMATS[panel.format],
        )

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """A copy the table may point at for the stack's lifetime. The model's own tensors can alias a
        caller's state dict, whose storage may move (share_memory_ when a tensor-parallel engine sends
        its shards to the workers frees the old storage): a pointer into it would dangle."""
        own = t.to(torch.float32).clone(memory_format=torch.contiguous_format)
        self._keep.append(own)
        return own

    def _layer(self, lw, slot: int) -> StackLayer:
        return StackLayer(
            self._own(lw.input_norm).data_ptr(),
            self._own(lw.post_norm).data_ptr(),
            self._linear(lw.qkv),
            self._linear(lw.o),
            self._linear(lw.gate_up),
            self._linear(lw.down),
            slot,
            lw.window or 0,
            lw.group,
            int(self.writes_kv),
        )

    def ready(self) -> bool:
        """Every linear holds a panel layout and the kernel builds: the stack can run at any row count."""
        panels = all(stack_panel(lin) is not None for lw in self.layers for lin in layer_linears(lw))
        return panels and self._build()

    def decide(self, runs: dict[int, bool]) -> None:
        """Measured decisions {bucket: runs} (worker/stack_timing.py): `rows` rows use the first bucket
        >= rows; above the last one the stack does not run."""
        self._decided = sorted(runs.items())
        self._runs_at.clear()

    def runs_at(self, rows: int) -> bool:
        """The stack serves `rows` decode rows: as measured where `decide` was called, else where the
        panel GEMM runs every linear at that count; and the kernel builds (compiled at construction
        where every linear keeps a panel layout, else at the first such count)."""
        runs = self._runs_at.get(rows)
        if runs is None:
            if self._decided is not None:
                bucket = next((r for b, r in self._decided if b >= rows), False)
                runs = bucket and self.ready()
            else:
                runs = all(lin.panel_at(rows) is not None for lw in self.layers for lin in layer_linears(lw))
                runs = runs and self._build()
            self._runs_at[rows] = runs
        return runs

    def run(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: Sequence[torch.Tensor],
        block_tables: Sequence[torch.Tensor],
        slot_mappings: Sequence[torch.Tensor] | None,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The layers over h (T, hidden) fp32 contiguous, in place: returns h with every layer's residuals
        added. positions (T,) int64; per kvcache group: seq_lens (T,) int32, block_tables (T, max_blocks)
        int32 and (with writes_kv) slot_mapping (T,) int64; kv_cache the engine's (num_kv_slots, 2,
        num_blocks, block_size, kv_heads, head_dim)."""
        keep = [positions.contiguous()]  # every tensor the C call reads stays alive until it returns
        groups = (StackGroup * self.num_groups)()
        for g in range(self.num_groups):
            lens = seq_lens[g].to(torch.int32).contiguous()
            table = block_tables[g].to(torch.int32)
            if table.stride(1) != 1:
                table = table.contiguous()
            slots = None
            if slot_mappings is not None:
                slots = slot_mappings[g].to(torch.int64).contiguous()
                keep.append(slots)
            keep += [lens, table]
            groups[g] = StackGroup(
                lens.data_ptr(),
                table.data_ptr(),
                table.stride(0),
                table.shape[1],
                None if slots is None else slots.data_ptr(),
            )
        _, _, num_blocks, block_size = kv_cache.shape[:4]
        step = StackStep(
            h.data_ptr(),
            h.shape[0],
            h.shape[1],
            keep[0].data_ptr(),
            self.rotary.cos.data_ptr(),
            self.rotary.sin.data_ptr(),
            self.rotary.cos.shape[0],
            self.num_heads,
            self.num_kv_heads,
            kv_cache.data_ptr(),
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            num_blocks,
            block_size,
            self.eps,
            self.scale,
            self._timings_ptr(),
        )
        # a bad input raises (kernels/native.py ERRORS) with nothing written
        self._fn(ctypes.byref(step), self._structs, len(self.layers), groups, torch.get_num_threads())
        self.calls += 1
        return h

    def _timings_ptr(self) -> int | None:
        t = self.timings
        if t is None:
            return None
        shape = (len(kernel_module.TIMED_PHASES),)
        if not (t.is_cpu and t.dtype == torch.float64 and t.shape == shape and t.is_contiguous()):
            raise ValueError(f"DecodeStack.timings must be a contiguous {shape} float64 CPU tensor: {t!r}")
        return t.data_ptr()

    def applies(self, h: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """The stack serves this batch of decode rows h (T, hidden): decided per row bucket (`runs_at`).
        h and kv_cache are the engine's (fp32 h, the cache it was built for); ValueError otherwise."""
        if not (h.dtype == torch.float32 and h.is_contiguous() and kv_cache.dtype == self.kv_dtype):
            raise ValueError(f"decode stack: fp32 contiguous rows and a {self.kv_dtype} cache, got {h.dtype}")
        return self.runs_at(h.shape[0])


def stack_panel(lin: Linear) -> PanelWeight | None:
    """The panel layout the stack reads for `lin` (fp32, 4-bit, bf16, or on AMX 4-/8-bit): the one its
    plan runs at one row, else the one it keeps besides (the spare the kernel chooser packed for the
    stack)."""
    at_one_row = lin.panel_at(1)
    if at_one_row is not None:
        return at_one_row
    return next((layout for layout in lin.layouts.values() if isinstance(layout, PanelWeight)), None)


def layer_linears(lw) -> tuple[Linear, ...]:
    """A decoder layer's linears, in the order the stack runs them."""
    return lw.qkv, lw.o, lw.gate_up, lw.down
