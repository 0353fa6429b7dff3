"""Closed-form calibration of the SwiftKV K/V projections (the first stage of `swiftkv distill`).

For every AcrossKV group leader g, k_proj_swiftkv[g] and v_proj_swiftkv[g] are ridge least-squares fits
from S = norm_swiftkv(h_L) to what the teacher's own layers of the group compute. RoPE comes after the
projection, so fitting pre-RoPE K is exact; a bias (attention_bias models) is fitted, never regularized.

weighting="uniform": every token alike, to the members' own K and V (the mean over the group is the
exact optimum for one shared projection):

    [W_g | b_g] = argmin sum_i sum_t ||W s_t + b - [K_i | V_i]_t||^2 + lam ||W||^2

weighting="attention" (the default) fits what the answers depend on. When serving, only answer tokens
run layers >= L, so only their queries count; each kv head h is fitted on its own:

- keys, weighted: token t's error costs in proportion to the attention the answer queries give it,
  m_iht = sum over answer queries q and query heads j of h's group of p_ij(q -> t), so no capacity is
  spent on keys nobody looks at.
- values, pooled: the attention output o_ij(q) = sum_t p_ij(q -> t) V_it is linear in V, so with
  V_t = W s_t + b it equals W s_ij(q) + b, s_ij(q) = sum_t p_ij(q -> t) s_t. W is fitted from s_ij(q)
  to the teacher's o_ij(q): errors that average out in attention cost nothing. The pooled rows are
  nearly collinear and fit noise on little data, so the per-token V fit is blended in as a prior worth
  VALUE_PRIOR_QUERIES answer queries, which fades as data grows.

Only fp64 sufficient statistics are kept (S^T W S once for uniform weights, per (leader, kv head) with
attention weights, and S^T W Y per fit), so memory does not grow with the data; statistics larger than
the device's memory are refused before any data is read. Worked sizes: 266 MiB for the embedded model
at L = 15; 34 GiB for Llama-3.1-8B at L = 16, where "uniform" needs 1.2 GiB. The ridge is relative,
lam = ridge * mean(diag(S^T W S)) over the hidden columns, so repeating the data changes nothing.

Everything not fitted comes from Snowflake's initialisation (swiftkv_reference.checkpoint.swiftkv_init):
norm_swiftkv = layer L's input_layernorm (S is computed with it), q_proj_swiftkv[i] = q_proj[i].

    config, state = calibrate(teacher, batches, num_key_value_layers=15)   # a full SwiftKV state dict

calibrate is `fit(teacher, collect_statistics(...))`; statistics of disjoint data add up
(`CalibrationStatistics`), so cross-validation reads the data once and fits each fold's complement.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass

import torch
from swiftkv_reference.checkpoint import swiftkv_config, swiftkv_init
from swiftkv_reference.config import SwiftKVConfig
from swiftkv_reference.memory import device_memory_bytes
from swiftkv_reference.model import RMSNorm, SwiftKVForCausalLM
from tqdm.auto import tqdm

from .batch import Batch
from .forward import ForwardOutput, training_forward
from .precision import autocast, check_precision

logger = logging.getLogger(__name__)

DEFAULT_RIDGE = 1e-4
WEIGHTINGS = ("attention", "uniform")
DEFAULT_WEIGHTING = "attention"
# bumped whenever the fit changes for the same data and settings: students cached under the user's
# cache directory (pipeline.cached_student) are then fitted again
CALIBRATION_VERSION = 3  # 3: the data and calibration's pass follow the resolved precision (bf16 on AMX)
# the pooled value fit's prior toward the per-token one, worth this many answer queries (see the docstring)
VALUE_PRIOR_QUERIES = 4096


class CalibrationError(ValueError):
    """Calibration that cannot produce a well-defined fit (no data, a singular system)."""


@dataclass
class _Pending:
    """The rank-one terms of one S^T W S (and its keys' S^T W Y columns) not yet added, for fp32 products."""

    columns: slice  # of S^T W Y
    nu: torch.Tensor  # (out,) the targets' centre
    a: torch.Tensor  # (width,) sum w c
    wy: torch.Tensor  # (out,) sum w y
    total: float = 0.0  # sum w


class Accumulator:
    """The fp64 normal equations of several ridge least-squares fits.

    in_features: columns of S; out_features: target key -> columns of its Y; bias: fit an intercept
    (a column of ones appended to S, not regularized). Unweighted, the keys share one input S and one
    S^T S, and every update carries all of them. weighted: every update gives each key it carries a
    weight per row (weighted least squares), and each key keeps its own S^T W S, so an update may carry
    any subset of the keys (with the rows of S that are theirs).

        acc = Accumulator(576, {15: 384, 16: 384}, bias=False)
        acc.update(s, {15: y15, 16: y16})   # s: (n, 576), y: (n, 384); any number of times
        fits = acc.solve(ridge=1e-4)        # key -> (weight (out, in), bias (out,) or None), fp64
        acc = Accumulator(576, {15: 384}, weighted=True)
        acc.update(s, {15: y15}, weights={15: w15})  # w15: (n,) >= 0

    The sums are fp64. So are each update's products by default; product_dtype=torch.float32 (faster,
    for rows that carry bf16's rounding anyway) takes them in fp32 on rows and targets centred on their
    first update's means, with the means' share added back in fp64 (_update_centered): the pooled
    value rows are nearly collinear averages, and plain fp32 products of them lose the fit.
    """

    def __init__(
        self,
        in_features: int,
        out_features: Mapping[Hashable, int],
        bias: bool = False,
        device: torch.device | str | None = None,
        weighted: bool = False,
        product_dtype: torch.dtype = torch.float64,
    ):
        if in_features < 1 or not out_features or min(out_features.values()) < 1:
            raise ValueError(f"bad Accumulator shape: in {in_features}, out {dict(out_features)}")
        if product_dtype not in (torch.float64, torch.float32):
            raise ValueError(f"product_dtype must be torch.float64 or torch.float32, got {product_dtype}")
        self.in_features, self.bias, self.weighted = in_features, bias, weighted
        self.product_dtype = product_dtype
        # fp32 products: every update's rows are centred on the first update's mean (fp64 (width,)), each
        # target on its first mean (_Pending.nu)
        self._center: torch.Tensor | None = None
        self._pending: dict[int, _Pending] = {}  # S^T W S index -> its terms not yet added (_flush)
        width = in_features + int(bias)
        self.out_features = dict(out_features)
        square = (len(self.out_features) if weighted else 1, width, width)
        self.sts = torch.zeros(square, dtype=torch.float64, device=device)  # S^T W S, per key if weighted
        self.sty = torch.zeros(width, sum(self.out_features.values()), dtype=torch.float64, device=device)
        self._columns, start = {}, 0  # key -> its columns of S^T Y (one matmul per update for all keys)
        for key, out in self.out_features.items():
            self._columns[key] = slice(start, start + out)
            start += out
        self._index = {key: j for j, key in enumerate(self.out_features)}  # key -> its S^T W S if weighted
        self.num_rows = 0  # rows of the updates (of each key's own updates if weighted: their maximum)
        self._rows = dict.fromkeys(self.out_features, 0)

    @property
    def nbytes(self) -> int:
        return self.sts.numel() * self.sts.element_size() + self.sty.numel() * self.sty.element_size()

    def __add__(self, other: Accumulator) -> Accumulator:
        """The normal equations of both accumulators' rows together (a new Accumulator): the fit of the
        union of their data."""
        if not isinstance(other, Accumulator):
            return NotImplemented
        self._flush()
        other._flush()
        shape = (self.in_features, self.out_features, self.bias, self.weighted)
        if shape != (other.in_features, other.out_features, other.bias, other.weighted):
            raise ValueError("only accumulators of the same fits (shapes, keys, bias, weighting) add up")
        total = self.zeros()
        total.sts = self.sts + other.sts.to(self.sts.device)
        total.sty = self.sty + other.sty.to(self.sty.device)
        total._rows = {key: rows + other._rows[key] for key, rows in self._rows.items()}
        total.num_rows = max(total._rows.values())
        return total

    def zeros(self) -> Accumulator:
        """An Accumulator of the same fits, without rows."""
        return Accumulator(
            self.in_features, self.out_features, self.bias, self.sts.device, self.weighted, self.product_dtype
        )

    def copy(self) -> Accumulator:
        self._flush()
        out = self.zeros()
        out.sts, out.sty = self.sts.clone(), self.sty.clone()
        out._rows, out.num_rows = dict(self._rows), self.num_rows  # its updates take centres of their own
        return out

    def update(
        self,
        s: torch.Tensor,
        targets: Mapping[Hashable, torch.Tensor],
        weights: Mapping[Hashable, torch.Tensor] | None = None,
    ) -> None:
        """Add rows: s (n, in_features) and, for every key (unweighted) or the keys it carries
        (weighted), its targets (n, out_features[key]) and, if weighted, its row weights (n,)."""
        if s.dim() != 2 or s.shape[1] != self.in_features:
            raise ValueError(f"s must be (n, {self.in_features}), got {tuple(s.shape)}")
        if (
            not targets
            or not set(targets) <= set(self.out_features)
            or (not self.weighted and set(targets) != set(self.out_features))
        ):
            raise ValueError(
                f"targets for {sorted(map(str, targets))}, expected {sorted(map(str, self.out_features))}"
                + ("" if self.weighted else " (all of them: they share S^T S)")
            )
        for key, y in targets.items():
            if tuple(y.shape) != (s.shape[0], self.out_features[key]):
                raise ValueError(
                    f"target {key!r} must be ({s.shape[0]}, {self.out_features[key]}), got {tuple(y.shape)}"
                )
        if (weights is not None) != self.weighted or (weights is not None and set(weights) != set(targets)):
            raise ValueError("a weighted Accumulator needs weights for every key, an unweighted one none")
        for key, w in (weights or {}).items():
            if tuple(w.shape) != (s.shape[0],) or bool((w < 0).any()):
                raise ValueError(f"weights {key!r} must be ({s.shape[0]},) and >= 0")
        s = s.detach().to(self.sts.device, torch.float64)
        if self.bias:
            s = torch.cat([s, s.new_ones(s.shape[0], 1)], dim=1)  # (n, in + 1)
        if self.product_dtype == torch.float32:
            with torch.autocast(s.device.type, enabled=False):  # fp32 products, also inside an autocast pass
                self._update_centered(s, targets, weights)
        elif not self.weighted:
            self.sts[0] += s.T @ s
            y = torch.cat([targets[key].detach().to(s) for key in self.out_features], dim=1)  # (n, sum out)
            self.sty += s.T @ y
        else:
            for key in targets:
                j = self._index[key]
                sw = s * weights[key].detach().to(s)[:, None]  # (n, in [+1])
                self.sts[j] += sw.T @ s
                self.sty[:, self._columns[key]] += sw.T @ targets[key].detach().to(s)
        for key in targets:
            self._rows[key] += s.shape[0]
        self.num_rows = max(self._rows.values())

    def _update_centered(
        self,
        s: torch.Tensor,
        targets: Mapping[Hashable, torch.Tensor],
        weights: Mapping[Hashable, torch.Tensor] | None,
    ) -> None:
        """update() with fp32 products: with x = c + mu (mu the rows' centre) and y = d + nu (the
        target's), sum w x x^T = sum w c c^T + a mu^T + mu a^T + (sum w) mu mu^T and sum w x y^T =
        sum w c d^T + a nu^T + mu (sum w y)^T, a = sum w c: only the centred products run in fp32,
        the rest in fp64. Rounding then scales with the rows' spread, not with their common part (the
        pooled value rows are averages: nearly one vector plus a little). The centres never change, so
        the rank-one terms are summed (a, sum w, sum w y) and added to S^T W S and S^T W Y when they
        are read (_flush)."""
        if s.shape[0] == 0:  # nothing to add, and no centre to take from no rows
            return
        if self._center is None:
            self._center = s.mean(0)  # the bias column's is 1: its centred column is 0
        c64 = s - self._center  # (n, width)
        c = c64.float()
        groups = (
            [(0, list(self.out_features), None)]  # unweighted: one S^T S for every key
            if not self.weighted
            else [(self._index[key], [key], weights[key].detach().to(s)) for key in targets]
        )
        for j, keys, w in groups:
            y = torch.cat([targets[key].detach().to(s) for key in keys], dim=1)  # (n, out)
            columns = slice(self._columns[keys[0]].start, self._columns[keys[-1]].stop)  # consecutive
            if j not in self._pending:  # the targets' centre: their first mean
                self._pending[j] = _Pending(
                    columns, y.mean(0), s.new_zeros(s.shape[1]), s.new_zeros(y.shape[1])
                )
            pending = self._pending[j]
            cw = c if w is None else c * w.float()[:, None]
            self.sts[j] += (cw.T @ c).double()
            self.sty[:, columns] += (cw.T @ (y - pending.nu).float()).double()
            pending.a += c64.sum(0) if w is None else w @ c64  # (width,) sum w c
            pending.wy += y.sum(0) if w is None else w @ y  # (out,) sum w y
            pending.total += float(s.shape[0]) if w is None else float(w.sum())

    def _flush(self) -> None:
        """Add the centred updates' pending rank-one terms (see _update_centered)."""
        mu = self._center
        for j, p in self._pending.items():
            self.sts[j] += torch.outer(mu, p.a) + torch.outer(p.a, mu) + p.total * torch.outer(mu, mu)
            self.sty[:, p.columns] += torch.outer(p.a, p.nu) + torch.outer(mu, p.wy)
            p.a.zero_()
            p.wy.zero_()
            p.total = 0.0

    def blend(self, into: Hashable, source: Hashable, scale: float, columns: slice | None = None) -> None:
        """Add `scale` times source's normal equations (its S^T W S, and its S^T W Y's `columns`) to
        into's: into's fit then also counts source's rows at weight `scale`, a prior toward source's
        fit (weighted accumulators only; into's target width must equal the columns taken)."""
        if not self.weighted or into == source or not scale >= 0:
            raise ValueError("blend needs a weighted Accumulator, two keys and a scale >= 0")
        self._flush()
        taken = self._columns[source]
        taken = range(taken.start, taken.stop)[columns or slice(None)]
        if len(taken) != self.out_features[into]:
            raise ValueError(
                f"blend: {len(taken)} columns of {source!r} for {self.out_features[into]} of {into!r}"
            )
        self.sts[self._index[into]] += scale * self.sts[self._index[source]]
        self.sty[:, self._columns[into]] += scale * self.sty[:, taken.start : taken.stop]
        self._rows[into] += self._rows[source]

    def solve(self, ridge: float = DEFAULT_RIDGE) -> dict[Hashable, tuple[torch.Tensor, torch.Tensor | None]]:
        """Solve (S^T W S + lam I) [W | b]^T = S^T W Y for every key (W = I unless weighted), lam =
        ridge * mean(diag(S^T W S)) over the hidden columns; returns key -> (weight (out, in), bias
        (out,) or None), fp64."""
        if not ridge >= 0:
            raise ValueError(f"ridge must be >= 0, got {ridge}")
        self._flush()
        empty = [key for key, rows in self._rows.items() if rows == 0]
        if empty:
            raise CalibrationError(
                "no calibration rows: the data selected no tokens"
                + (f" (for {', '.join(map(str, empty))})" if len(empty) < len(self._rows) else "")
            )
        n_in = self.in_features
        fits = {}
        for j, (key, columns) in enumerate(self._columns.items()):
            a = self.sts[j if self.weighted else 0].clone()
            if j == 0 or self.weighted:
                lam = ridge * float(a.diagonal()[:n_in].mean())
                a.diagonal()[:n_in] += lam
                chol, info = torch.linalg.cholesky_ex(a)
                if int(info) != 0:
                    raise CalibrationError(
                        f"the calibration system is singular ({self.num_rows} rows for {a.shape[0]} "
                        f"unknowns, ridge {ridge}): use more tokens or a larger ridge"
                    )
            w = torch.cholesky_solve(self.sty[:, columns], chol)  # (in [+1], out)
            fits[key] = (w[:n_in].T.contiguous(), w[n_in].clone() if self.bias else None)
        return fits


@dataclass
class CalibrationStatistics:
    """What a calibration pass over some data leaves: the fp64 normal equations of every fit
    (`Accumulator`) and the token counts the fit needs. Statistics of disjoint data add up to those of
    their union, so K-fold cross-validation reads each fold once and fits each fold's complement from
    the sums:

        parts = [collect_statistics(teacher, batches(fold), 15) for fold in folds]
        config, state = fit(teacher, sum(parts[1:], parts[0].empty()))   # scored on folds[0]
    """

    num_key_value_layers: int
    key_value_group_size: int
    weighting: str
    accumulator: Accumulator
    num_tokens: int  # key rows (every real token, or the answer tokens with answers_only)
    num_queries: int  # answer tokens

    def __add__(self, other: CalibrationStatistics) -> CalibrationStatistics:
        if not isinstance(other, CalibrationStatistics):
            return NotImplemented
        mine = (self.num_key_value_layers, self.key_value_group_size, self.weighting)
        theirs = (other.num_key_value_layers, other.key_value_group_size, other.weighting)
        if mine != theirs:
            raise ValueError(f"calibration statistics of (L, G, weighting) {mine} and {theirs} do not add up")
        return dataclasses.replace(
            self,
            accumulator=self.accumulator + other.accumulator,
            num_tokens=self.num_tokens + other.num_tokens,
            num_queries=self.num_queries + other.num_queries,
        )

    def empty(self) -> CalibrationStatistics:
        """Statistics of no data with the same fits (the start of a sum)."""
        return dataclasses.replace(self, accumulator=self.accumulator.zeros(), num_tokens=0, num_queries=0)


def calibrate(
    teacher: SwiftKVForCausalLM,
    batches: Iterable[Batch],
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    *,
    ridge: float = DEFAULT_RIDGE,
    weighting: str = DEFAULT_WEIGHTING,
    answers_only: bool = False,
    progress: bool = True,
    keep_states: Collection[int] = (),
    on_batch: Callable[[Batch, ForwardOutput], object] | None = None,
    precision: str = "fp32",
) -> tuple[SwiftKVConfig, dict[str, torch.Tensor]]:
    """A SwiftKV (config, state_dict) whose k/v_proj_swiftkv are fitted to `teacher` (a plain model,
    L == N) on `batches`; every other tensor as `swiftkv_init` sets it (Snowflake's names, the
    teacher's dtype, on CPU): `fit` of `collect_statistics`. L, G, ridge and the teacher are checked
    before any batch is read."""
    _check_ridge(ridge)
    statistics = collect_statistics(
        teacher,
        batches,
        num_key_value_layers,
        key_value_group_size,
        weighting=weighting,
        answers_only=answers_only,
        progress=progress,
        keep_states=keep_states,
        on_batch=on_batch,
        precision=precision,
    )
    return fit(teacher, statistics, ridge)


def collect_statistics(
    teacher: SwiftKVForCausalLM,
    batches: Iterable[Batch],
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    *,
    weighting: str = DEFAULT_WEIGHTING,
    answers_only: bool = False,
    progress: bool = True,
    keep_states: Collection[int] = (),
    on_batch: Callable[[Batch, ForwardOutput], object] | None = None,
    precision: str = "fp32",
) -> CalibrationStatistics:
    """calibrate's pass over `batches`: one teacher forward per batch, on the teacher's device, without
    gradients; a tqdm bar over batches. Key rows (and value rows with uniform weighting): every real
    token, or only the answer tokens with answers_only; the attention weighting's queries are the answer
    tokens. L, G, the weighting and the statistics' memory are checked before any batch is read.

    on_batch(batch, out), if given, sees each batch (on the teacher's device) and the teacher's
    ForwardOutput over it: `residual` (h_L), `hidden` (the stream entering the final norm) and the
    `states` of keep_states; distillation keeps them (TeacherCache.offer) instead of running the same
    teacher again.

    precision: "fp32", or "bf16": the teacher's pass under bf16 autocast and the statistics' products
    in fp32 (Accumulator's product_dtype; the sums stay fp64): faster, and the fit scores as fp32's
    does (docs/performance.md)."""
    check_precision(precision, "calibration precision")
    if precision == "auto":
        raise ValueError("calibration precision must be resolved (fp32 or bf16), got 'auto'")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
    config = _student_config(teacher, num_key_value_layers, key_value_group_size)
    device = next(teacher.parameters()).device
    big_l, g, n = num_key_value_layers, key_value_group_size, config.num_hidden_layers
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    kv_dim = kv_heads * head_dim
    leaders = list(range(big_l, n, g))
    norm = RMSNorm(config.hidden_size, config.rms_norm_eps).to(device)
    # norm_swiftkv as swiftkv_init sets it: layer L's input_layernorm
    norm.weight.data.copy_(teacher.model.layers[big_l].input_layernorm.weight.detach())
    weighted = weighting == "attention"
    if weighted:  # per (leader, kv head): K and V per token, V pooled (see the module docstring)
        out_features = {}
        for leader, h in itertools.product(leaders, range(kv_heads)):
            out_features |= {(leader, h, "token"): 2 * head_dim, (leader, h, "pooled"): head_dim}
    else:
        out_features = {leader: 2 * kv_dim for leader in leaders}
    width = config.hidden_size + int(config.attention_bias)
    need = 8 * width * ((len(out_features) if weighted else 1) * width + sum(out_features.values()))
    total = device_memory_bytes(device)
    if total is not None and need > total:
        raise CalibrationError(
            f"weighting={weighting!r} keeps {need / 2**30:.1f} GiB of fp64 statistics, more than the "
            f"{total / 2**30:.1f} GiB of {device} memory"
            + (": use weighting='uniform' (--weighting uniform)" if weighted else "")
        )
    products = torch.float32 if precision == "bf16" else torch.float64
    acc = Accumulator(config.hidden_size, out_features, config.attention_bias, device, weighted, products)
    logger.info("calibration statistics: %.1f MiB (fp64)", acc.nbytes / 2**20)

    was_training = teacher.training
    teacher.eval()
    total = len(batches) if hasattr(batches, "__len__") else None
    num_tokens = num_queries = 0
    try:
        with torch.no_grad(), autocast(precision, device):
            for batch in tqdm(batches, total=total, desc="calibrate", unit="batch", disable=not progress):
                batch = batch.to(device)
                rows = batch.answer_mask if answers_only else batch.attention_mask  # (B, T)
                hook = _AttentionStatistics(config, norm, acc, batch.answer_mask) if weighted else None
                out = training_forward(
                    teacher,
                    batch.input_ids,
                    swiftkv=False,
                    compute_logits=False,
                    capture_from=big_l,
                    attention_hook=hook,
                    keep_states=keep_states,
                )
                if on_batch is not None:
                    on_batch(batch, out)
                s = norm(out.residual[rows])  # (n_rows, hidden)
                num_tokens += s.shape[0]
                num_queries += int(batch.answer_mask.sum())
                if not weighted:  # member m of every group at once: they share S^T S
                    for m in range(g):
                        acc.update(s, {ld: torch.cat(out.kv[ld + m], -1)[rows] for ld in leaders})
                    continue
                for m in range(g):  # per token (the hook took the pooled values); member m of every group
                    targets, weights = {}, {}
                    for leader in leaders:
                        kv = (x[rows].view(-1, kv_heads, head_dim) for x in out.kv[leader + m])
                        k, v = kv  # (n_rows, kv_heads, d)
                        mass = hook.masses.pop(leader + m)[rows]  # (n_rows, kv_heads)
                        for h in range(kv_heads):
                            targets[(leader, h, "token")] = torch.cat([k[:, h], v[:, h]], -1)
                            weights[(leader, h, "token")] = mass[:, h]
                    acc.update(s, targets, weights)  # one update: S converted and centred once
    finally:
        teacher.train(was_training)
    return CalibrationStatistics(big_l, g, weighting, acc, num_tokens, num_queries)


def fit(
    teacher: SwiftKVForCausalLM, statistics: CalibrationStatistics, ridge: float = DEFAULT_RIDGE
) -> tuple[SwiftKVConfig, dict[str, torch.Tensor]]:
    """The SwiftKV (config, state_dict) of `teacher` whose k/v_proj_swiftkv are the ridge fits of
    `statistics` (collected on this teacher); `statistics` is left as it was, so it can be fitted again
    or added to."""
    _check_ridge(ridge)
    big_l, g = statistics.num_key_value_layers, statistics.key_value_group_size
    _student_config(teacher, big_l, g)
    teacher_state = {k: v.detach().cpu() for k, v in teacher.state_dict().items()}
    config, state = swiftkv_init(teacher.config, teacher_state, big_l, g)
    if statistics.num_tokens == 0:
        raise CalibrationError("no calibration rows: the data selected no tokens")
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    kv_dim = kv_heads * head_dim
    leaders = list(range(big_l, config.num_hidden_layers, g))
    weighted = statistics.weighting == "attention"
    acc = statistics.accumulator
    if weighted:  # the prior is added to a copy: the statistics stay those of the data
        acc = acc.copy()
        prior = VALUE_PRIOR_QUERIES / max(statistics.num_queries, 1)
        for leader, h in itertools.product(leaders, range(kv_heads)):
            acc.blend((leader, h, "pooled"), (leader, h, "token"), prior, slice(head_dim, None))
    fits = acc.solve(ridge)
    for leader in leaders:
        prefix = f"model.layers.{leader}.self_attn."
        for j, proj in enumerate(("k_proj_swiftkv", "v_proj_swiftkv")):
            if weighted:  # (kv_dim, hidden) and (kv_dim,) from the heads' fits, in head order
                rows_j = slice(None, head_dim) if j == 0 else slice(None)  # K: the token fit's first half
                heads = [fits[(leader, h, "token" if j == 0 else "pooled")] for h in range(kv_heads)]
                w = torch.cat([hw[rows_j] for hw, _ in heads])
                b = torch.cat([hb[rows_j] for _, hb in heads]) if config.attention_bias else None
            else:
                w, b = fits[leader]
                w, b = (
                    w[j * kv_dim : (j + 1) * kv_dim],
                    None if b is None else b[j * kv_dim : (j + 1) * kv_dim],
                )
            dtype = state[f"{prefix}{proj}.weight"].dtype
            state[f"{prefix}{proj}.weight"] = w.to(dtype).cpu()
            if b is not None:
                state[f"{prefix}{proj}.bias"] = b.to(dtype).cpu()
    logger.info(
        "calibrated %d K/V projections (L=%d of %d, G=%d) on %d tokens, ridge %g, %s weighting",
        len(leaders),
        big_l,
        config.num_hidden_layers,
        g,
        statistics.num_tokens,
        ridge,
        statistics.weighting,
    )
    return config, state


def _check_ridge(ridge: float) -> None:
    if not ridge >= 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")


def _student_config(teacher: SwiftKVForCausalLM, num_key_value_layers: int, key_value_group_size: int):
    """The student's config (L, G checked against the teacher; CalibrationError unless L < N)."""
    config = swiftkv_config(teacher.config, num_key_value_layers, key_value_group_size)
    if not config.is_swiftkv:
        raise CalibrationError(
            f"num_key_value_layers must be < num_hidden_layers ({config.num_hidden_layers}) to calibrate"
        )
    return config


class _AttentionStatistics:
    """training_forward's attention hook for weighting="attention": per layer i >= L, each kv head's
    key weights, and the value fit's rows (see the module docstring).

    queries: (B, T) bool, the answer tokens. masses[i]: (B, T, kv_heads), the attention each key gets
    from those queries through the query heads of each kv head's group.
    """

    def __init__(self, config: SwiftKVConfig, norm: RMSNorm, acc: Accumulator, queries: torch.Tensor):
        self.config, self.norm, self.acc, self.queries = config, norm, acc, queries
        self.masses: dict[int, torch.Tensor] = {}
        self.s: torch.Tensor | None = None

    def __call__(self, i: int, h: torch.Tensor, probs: torch.Tensor, attn: torch.Tensor) -> None:
        cfg = self.config
        batch, heads, num_tokens, _ = probs.shape
        kv_heads, head_dim = cfg.num_key_value_heads, cfg.head_dim
        rep = heads // kv_heads
        if i == cfg.num_key_value_layers:
            self.s = self.norm(h)  # (B, T, hidden)
        mass = (probs * self.queries[:, None, :, None].to(probs.dtype)).sum(2)  # (B, heads, T)
        self.masses[i] = mass.view(batch, kv_heads, rep, num_tokens).sum(2).transpose(1, 2)
        # pooled S and the teacher's output at the queries, rows in (query, head) order
        pooled = torch.cat(  # (n_queries, heads, hidden)
            [(probs[b][:, q] @ self.s[b]).transpose(0, 1) for b, q in enumerate(self.queries)]
        )
        out = attn.view(batch, num_tokens, heads, head_dim)[self.queries]  # (n_queries, heads, head_dim)
        leader = cfg.group_leader(i)
        ones = pooled.new_ones(pooled.shape[0] * rep)
        for kv_head in range(kv_heads):
            group = slice(kv_head * rep, (kv_head + 1) * rep)
            key = (leader, kv_head, "pooled")
            self.acc.update(
                pooled[:, group].reshape(-1, pooled.shape[-1]),
                {key: out[:, group].reshape(-1, head_dim).to(pooled.dtype)},
                {key: ones},
            )
