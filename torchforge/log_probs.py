"""Log-probabilities and entropy of tokens under a language model's softmax, chunked.

Three primitives, each with its own autograd backward so that memory stays bounded:

- :func:`token_log_probs`: ``log softmax(logits / temperature)`` at the given tokens,
  from [B, T, V] logits; the only [B, T, V] buffer it ever allocates is the gradient of
  the logits, in the backward.
- :func:`fused_token_log_probs`: the same from the last hidden states [B, T, H] and the
  LM-head weight [V, H]; the logits exist only one chunk at a time, in the forward and
  again (recomputed) in the backward, so no [B, T, V] tensor exists at any time.
- :func:`token_entropy`: the entropy of ``softmax(logits / temperature)`` per position.

All maths is float32 (float64 for float64 inputs) one chunk at a time, whatever the input
dtype: bf16 logits are never copied to float32 whole.
"""

from __future__ import annotations

import math

import torch

from torchforge.batch import batch_args
from torchforge.errors import (
    DTypeError,
    InvalidArgumentError,
    ShapeError,
    check_float,
    check_integer,
    check_temperature,
    check_tensor,
    reraise_as,
    shape_str,
)

__all__ = [
    "token_log_probs",
    "fused_token_log_probs",
    "token_entropy",
    "chunk_rows",
    "row_chunks",
    "LOGITS_CHUNK_ELEMENTS",
    "FUSED_CHUNK_ELEMENTS",
]

# The one chunk-size policy of every chunked kernel (token_log_probs, token_entropy,
# fused_token_log_probs, and kl.exact_kl): about 8M logits per chunk (one 32 MB float32
# buffer, reused by every chunk), i.e. ``LOGITS_CHUNK_ELEMENTS // V`` rows. Few chunks
# matter more than cache fit on a CPU shared with other jobs: every kernel ends with a
# barrier of its threads, and a barrier costs up to a scheduler time slice when one of
# them has been descheduled; 8M logits is also big enough for the fused matmuls to run
# at full speed.
LOGITS_CHUNK_ELEMENTS = 1 << 23
# The same policy under the name the fused kernel's docs use (one value, not a second knob).
FUSED_CHUNK_ELEMENTS = LOGITS_CHUNK_ELEMENTS
# Rows per tile of the fused backward (the tile spans a slice of the vocabulary).
_FUSED_BACKWARD_ROWS = 4096


# ----------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------

def chunk_rows(V: int, *, chunk_size: int | None = None) -> int:
    """Rows per chunk of a kernel over rows of ``V`` logits: the chunk-size policy of every
    chunked kernel (``token_log_probs``, ``token_entropy``, ``fused_token_log_probs``,
    ``exact_kl``).

    ``chunk_size`` when given, else ``max(1, LOGITS_CHUNK_ELEMENTS // V)``: about 8M logits,
    one 32 MB float32 buffer, per chunk.

    Args:
        V: the vocabulary (row width); >= 0.
        chunk_size: rows per chunk (an int >= 1), or None for the policy.

    Returns:
        int >= 1.

    Example:
        >>> chunk_rows(50_000)                    # 8,388,608 // 50,000
        167
        >>> chunk_rows(50_000, chunk_size=64)
        64
    """
    if chunk_size is None:
        return max(1, LOGITS_CHUNK_ELEMENTS // max(1, V))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidArgumentError(f"chunk_rows: chunk_size must be an int >= 1 or None, got {chunk_size!r}")
    return chunk_size


def row_chunks(rows: int | torch.Tensor, chunk_size: int):
    """The chunks a chunked kernel walks: slices of ``range(rows)`` of at most
    ``chunk_size`` rows, or, for a 1-D index tensor ``rows``, its pieces of at most
    ``chunk_size`` indices.

    Args:
        rows: the number of rows, or a 1-D int64 tensor of row indices.
        chunk_size: the most rows per chunk (see :func:`chunk_rows`); >= 1.

    Returns:
        An iterator of slices (an int ``rows``) or of 1-D index tensors.

    Example:
        >>> list(row_chunks(5, 2))
        [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    if isinstance(rows, torch.Tensor):
        yield from rows.split(chunk_size)
        return
    for start in range(0, rows, chunk_size):
        yield slice(start, min(rows, start + chunk_size))


def _chunk_rows(fn: str, chunk_size, V: int) -> int:
    """:func:`chunk_rows`, its errors naming ``fn``."""
    with reraise_as(fn):
        return chunk_rows(V, chunk_size=chunk_size)



def _check_head_transform(fn: str, logit_scale, softcap) -> tuple[float, float | None]:
    """``(logit_scale, softcap)`` as floats: ``logit_scale`` 1.0 when None; each a finite
    number > 0."""
    values = {"logit_scale": logit_scale, "softcap": softcap}
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgumentError(f"{fn}: {name} must be a number or None, got {type(value).__name__}")
        if not (math.isfinite(value) and value > 0):
            raise InvalidArgumentError(f"{fn}: {name} must be a finite number > 0 or None, got {value!r}")
    return float(1.0 if logit_scale is None else logit_scale), (None if softcap is None else float(softcap))


def _check_tokens(fn: str, tokens, expected_shape, shape_desc: str, V: int) -> None:
    check_tensor(fn, "tokens", tokens)
    check_integer(fn, "tokens", tokens)
    if tokens.shape != expected_shape:
        raise ShapeError(
            f"{fn}: tokens has shape {shape_str(tokens)} but {shape_desc}; "
            f"expected {tuple(expected_shape)}"
        )
    if tokens.numel() > 0:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= V:
            raise InvalidArgumentError(
                f"{fn}: tokens has values in [{lo}, {hi}]; expected token ids in [0, {V}) "
                f"for a vocabulary of V={V}"
            )


def _check_vocab(fn: str, name: str, x: torch.Tensor, dim: int) -> None:
    if x.shape[dim] == 0:
        raise ShapeError(f"{fn}: {name} has shape {shape_str(x)}; expected a vocabulary V >= 1")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, T, V] -> [B * T, V] without a copy whenever the strides allow it."""
    B, T, V = x.shape
    try:
        return x.view(B * T, V)
    except RuntimeError:  # e.g. logits[:, :-1] of a contiguous [B, T + 1, V]
        return None


def _segments(x: torch.Tensor):
    """The [B, T, V] tensor ``x`` as 2-D row blocks ``(first_row, [n, V] view)``, no copy."""
    flat = _rows(x)
    if flat is not None:
        return [(0, flat)]
    T = x.shape[1]
    return [(b * T, x[b]) for b in range(x.shape[0])]


def _chunks(x: torch.Tensor, chunk_size: int):
    """``(rows, chunk)`` over the [B, T, V] tensor ``x``: ``chunk`` is the [n, V] view of
    the flat rows ``rows`` (a slice of ``range(B * T)``), at most ``chunk_size`` of them."""
    for first, seg in _segments(x):
        for rows in row_chunks(seg.shape[0], chunk_size):
            yield slice(first + rows.start, first + rows.stop), seg[rows]


def _scaled_into(buf: torch.Tensor, chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """``z = chunk / temperature`` in ``buf``'s dtype: ``chunk`` itself when it already is
    (compute dtype, temperature 1), else written into ``buf`` (same shape) and returned.
    A bf16 chunk is converted first and never divided in bf16."""
    if chunk.dtype == buf.dtype:
        return chunk if temperature == 1.0 else torch.div(chunk, temperature, out=buf)
    buf.copy_(chunk)
    return buf.div_(temperature) if temperature != 1.0 else buf


def _chunk_buffer(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """One [chunk_size, V] buffer in ``dtype``, reused by every chunk of ``x`` [B, T, V]."""
    B, T, V = x.shape
    return torch.empty((max(1, min(chunk_size, B * T)), V), dtype=dtype, device=x.device)


# ----------------------------------------------------------------------------------------
# token_log_probs
# ----------------------------------------------------------------------------------------

class _TokenLogProbs(torch.autograd.Function):
    """``log_softmax(z)[tok]`` with ``z = logits / temperature``, row chunk by row chunk.

    Forward, per chunk: ``log_softmax(z)`` into one [chunk, V] buffer reused by every chunk
    (a bf16 chunk is first converted into it, float32 logits at temperature 1 are read
    where they are), then ``log_p[tok]`` gathered. Saves the logits (the input itself, no
    copy) and the tokens; the backward recomputes ``softmax(z)`` one chunk at a time and
    writes ``(onehot - softmax(z)) * grad / temperature`` into the [N, V] gradient, in the
    gradient's own rows when it has the compute dtype.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size, dtype):
        B, T, V = logits.shape
        flat_tokens = tokens.reshape(B * T, 1)
        out = torch.empty((B * T, 1), dtype=dtype, device=logits.device)
        buf = _chunk_buffer(logits, chunk_size, dtype)
        for rows, chunk in _chunks(logits, chunk_size):
            b = buf[: chunk.shape[0]]
            z = _scaled_into(b, chunk, temperature)
            log_p = torch.log_softmax(z, dim=-1, out=b)  # in place when z is the buffer
            torch.gather(log_p, -1, flat_tokens[rows], out=out[rows])
        ctx.save_for_backward(logits, flat_tokens)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return out.view(B, T)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, flat_tokens = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.temperature, ctx.chunk_size, ctx.dtype
        B, T, V = logits.shape
        # grad_z = grad_out * (onehot - p); d z / d logits = 1 / temperature.
        scale = grad_out.reshape(B * T, 1).to(dtype) / temperature
        neg_scale = scale.neg()
        grad = torch.empty((B, T, V), dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(B * T, V)
        # float32 (float64) logits: the maths runs in the gradient's rows themselves;
        # otherwise in one float32 chunk buffer, cast once into the gradient.
        buf = _chunk_buffer(logits, chunk_size, dtype) if grad.dtype != dtype else None
        for rows, chunk in _chunks(logits, chunk_size):
            g = flat_grad[rows]
            b = g if buf is None else buf[: chunk.shape[0]]
            z = _scaled_into(b, chunk, temperature)
            p = torch.softmax(z, dim=-1, out=b)  # in place when z is b
            p.mul_(neg_scale[rows]).scatter_add_(-1, flat_tokens[rows], scale[rows])
            if buf is not None:
                g.copy_(p)
        return grad, None, None, None, None


@batch_args
def token_log_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probability of each given token under ``softmax(logits / temperature)``.

    With ``z = logits / temperature``:

    ``log_probs[b, t] = z[b, t, tokens[b, t]] - logsumexp_v z[b, t, v]``

    and its gradient ``d log_probs[b, t] / d logits[b, t, v] = (onehot(tokens[b, t])_v -
    softmax(z[b, t])_v) / temperature``.

    Args:
        logits: [B, T, V] float logits (any float dtype; bf16 stays bf16 in memory).
            For next-token prediction pass the logits that predict ``tokens``, e.g.
            ``model_logits[:, :-1]`` (a strided view is read without a copy).
        tokens: [B, T] integer token ids in ``[0, V)``.
        temperature: > 0; the logits are divided by it first, as in sampling, so that
            training sees the distribution the samples were drawn from.
        chunk_size: rows (positions) per chunk; default about 8M logits per chunk
            (``LOGITS_CHUNK_ELEMENTS // V``). The result does not depend on it.

    Returns:
        [B, T] float32 log-probs (float64 for float64 logits), <= 0.

    Example:
        >>> import torch
        >>> # softmax(0, log 3) = (1/4, 3/4): log-probs log(1/4) and log(3/4)
        >>> logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
        >>> token_log_probs(logits, torch.tensor([[0, 1]]))
        tensor([[-1.3863, -0.2877]])

    References:
        Temperature-scaled log-probs of sampled tokens as the policy's log-likelihood
        in PPO for language models: Ouyang et al., https://arxiv.org/abs/2203.02155

    Note:
        Memory: no [B, T, V] log-softmax and no float32 copy of bf16 logits is made:
        each pass works in one [chunk_size, V] buffer in the compute dtype, allocated once
        and reused by every chunk (float32 logits' softmax in the backward is written
        straight into the gradient). The forward saves nothing but its inputs (the logits
        are not copied); the backward recomputes the softmax chunk by chunk and allocates
        one [B, T, V] buffer, the gradient of the logits (in their dtype). TRL and verl
        compute the same quantity as ``logits.gather - logsumexp`` with a Python loop over
        the rows of the batch.
    """
    fn = "token_log_probs"
    check_tensor(fn, "logits", logits, ndim=3)
    check_float(fn, "logits", logits)
    _check_vocab(fn, "logits", logits, -1)
    _check_tokens(fn, tokens, logits.shape[:-1], f"logits has shape {shape_str(logits)}", logits.shape[-1])
    if tokens.device != logits.device:
        raise InvalidArgumentError(
            f"{fn}: tokens is on {tokens.device} but logits is on {logits.device}; expected the same device"
        )
    temperature = check_temperature(fn, temperature)
    chunk_size = _chunk_rows(fn, chunk_size, logits.shape[-1])
    dtype = _compute_dtype(logits.dtype)
    return _TokenLogProbs.apply(logits, tokens.long(), temperature, chunk_size, dtype)


# ----------------------------------------------------------------------------------------
# token_entropy
# ----------------------------------------------------------------------------------------

class _TokenEntropy(torch.autograd.Function):
    """``H = -sum_v p_v log p_v`` by row chunks; saves logits (the input) and H [N].

    Backward: ``d H / d z_v = -p_v (log p_v + H)``, recomputed chunk by chunk, with
    ``p log p`` written as ``xlogy(p, p)`` so that ``0 log 0 = 0`` (no NaN at ``-inf``
    logits).
    """

    @staticmethod
    def forward(ctx, logits, temperature, chunk_size, dtype):
        B, T, V = logits.shape
        out = torch.empty(B * T, dtype=dtype, device=logits.device)
        buf = _chunk_buffer(logits, chunk_size, dtype)
        for rows, chunk in _chunks(logits, chunk_size):
            b = buf[: chunk.shape[0]]
            z = _scaled_into(b, chunk, temperature)
            p = torch.softmax(z, dim=-1, out=b)
            torch.sum(torch.special.entr(p, out=p), dim=-1, out=out[rows])  # entr = -p log p
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return out.view(B, T)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, entropy = ctx.saved_tensors
        temperature, chunk_size, dtype = ctx.temperature, ctx.chunk_size, ctx.dtype
        B, T, V = logits.shape
        neg_scale = grad_out.reshape(B * T, 1).to(dtype) / -temperature
        ent = entropy.unsqueeze(-1)
        grad = torch.empty((B, T, V), dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(B * T, V)
        buf = _chunk_buffer(logits, chunk_size, dtype)  # p
        # p (log p + H), in the gradient's rows when they have the compute dtype
        buf_t = _chunk_buffer(logits, chunk_size, dtype) if grad.dtype != dtype else None
        for rows, chunk in _chunks(logits, chunk_size):
            g = flat_grad[rows]
            b = buf[: chunk.shape[0]]
            z = _scaled_into(b, chunk, temperature)
            p = torch.softmax(z, dim=-1, out=b)
            # p (log p + H) = xlogy(p, p) + p H
            t = torch.xlogy(p, p, out=g if buf_t is None else buf_t[: chunk.shape[0]])
            t.addcmul_(p, ent[rows]).mul_(neg_scale[rows])
            if buf_t is not None:
                g.copy_(t)
        return grad, None, None, None


@batch_args
def token_entropy(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position, chunked.

    With ``z = logits / temperature`` and ``log_p = z - logsumexp_v z``:

    ``entropy[b, t] = -sum_v exp(log_p[b, t, v]) * log_p[b, t, v]``

    and its gradient ``d entropy / d logits_v = -p_v (log_p_v + entropy) / temperature``.

    Args:
        logits: [B, T, V] float logits (any float dtype).
        temperature: > 0; the logits are divided by it first.
        chunk_size: rows (positions) per chunk; default about 8M logits per chunk. The
            result does not depend on it.

    Returns:
        [B, T] float32 entropies (float64 for float64 logits), in ``[0, log V]``.

    Example:
        >>> import torch
        >>> # uniform over 4 tokens: log 4; p = (1, 0) (a -inf logit): 0
        >>> token_entropy(torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, -math.inf, -math.inf, -math.inf]]]))
        tensor([[1.3863, 0.0000]])

    References:
        Entropy bonus in policy-gradient losses: Mnih et al., "Asynchronous methods for
        deep reinforcement learning", https://arxiv.org/abs/1602.01783

    Note:
        ``0 log 0 = 0``: tokens with logit ``-inf`` (masked out) contribute nothing and
        get zero gradient. Memory as in :func:`token_log_probs`: only the [B, T]
        entropies are saved; the gradient of the logits is the only [B, T, V] buffer.
    """
    fn = "token_entropy"
    check_tensor(fn, "logits", logits, ndim=3)
    check_float(fn, "logits", logits)
    _check_vocab(fn, "logits", logits, -1)
    temperature = check_temperature(fn, temperature)
    chunk_size = _chunk_rows(fn, chunk_size, logits.shape[-1])
    return _TokenEntropy.apply(logits, temperature, chunk_size, _compute_dtype(logits.dtype))


# ----------------------------------------------------------------------------------------
# fused_token_log_probs
# ----------------------------------------------------------------------------------------

def _logits_tile(hidden, weight, bias, head, z, mm=None, u=None):
    """The transformed logits ``z'' = head(hidden @ weight.T + bias)`` [n, v], written into
    ``z`` (a [n, v] buffer in the compute dtype) and returned.

    ``head = (logit_scale, softcap, temperature)``: ``z'' = softcap * tanh(logit_scale * z /
    softcap) / temperature``, or ``z'' = logit_scale * z / temperature`` without a softcap.
    ``mm`` is a [n, v] buffer in the inputs' dtype for the matmul when it differs from
    ``z``'s (bf16 inputs), else None; ``u``, when given with a softcap, receives
    ``tanh(logit_scale * z / softcap)`` for the backward.
    """
    logit_scale, softcap, temperature = head
    target = z if mm is None else mm
    if bias is None:
        torch.mm(hidden, weight.t(), out=target)
    else:
        torch.addmm(bias, hidden, weight.t(), out=target)
    if mm is not None:
        z.copy_(mm)
    if softcap is None:
        factor = logit_scale / temperature
        return z.mul_(factor) if factor != 1.0 else z
    z.mul_(logit_scale / softcap)
    if u is None:
        return z.tanh_().mul_(softcap / temperature)
    torch.tanh(z, out=u)
    return torch.mul(u, softcap / temperature, out=z)


def _tile(flat: torch.Tensor | None, n: int, v: int) -> torch.Tensor | None:
    """The first ``n * v`` elements of the flat buffer ``flat`` as a contiguous [n, v]."""
    return None if flat is None else flat[: n * v].view(n, v)


class _FusedTokenLogProbs(torch.autograd.Function):
    """Token log-probs (and entropy) from hidden states and the LM head, never building
    the [N, V] logits.

    Forward: row chunks of ``chunk_size`` rows x all V; saves hidden, weight, bias, the
    logsumexp [N] (recovered as ``z''[tok] - log_p[tok]``) and the entropy [N]. Backward:
    tiles of ``_FUSED_BACKWARD_ROWS`` rows x a slice of the vocabulary (``chunk_size * V``
    logits each), so that ``grad_weight`` is written once per row block rather than
    accumulated once per row chunk. The head transform's derivative,
    ``d z'' / d z = logit_scale * (1 - u**2) / temperature`` with ``u = tanh(logit_scale * z
    / softcap)`` (``logit_scale / temperature`` without a softcap), multiplies the
    gradient of each tile before its matmuls.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, head, chunk_size, with_entropy, dtype):
        N, V = hidden.shape[0], weight.shape[0]
        lse = torch.empty(N, dtype=dtype, device=hidden.device)
        out = torch.empty(N, dtype=dtype, device=hidden.device)
        entropy = torch.empty(N, dtype=dtype, device=hidden.device) if with_entropy else None
        tok = tokens.unsqueeze(-1)
        # one logits tile buffer (and one for the bf16 matmul), reused by every chunk
        n_max = min(N, chunk_size)
        z_flat = torch.empty(n_max * V, dtype=dtype, device=hidden.device)
        mm_flat = torch.empty(n_max * V, dtype=hidden.dtype, device=hidden.device) if hidden.dtype != dtype else None
        for rows in row_chunks(N, chunk_size):
            h = hidden[rows]
            n = h.shape[0]
            z = _logits_tile(h, weight, bias, head, _tile(z_flat, n, V), _tile(mm_flat, n, V))
            torch.gather(z, -1, tok[rows], out=lse[rows].unsqueeze(-1))  # z[tok], before z is overwritten
            log_p = torch.log_softmax(z, dim=-1, out=z)
            torch.gather(log_p, -1, tok[rows], out=out[rows].unsqueeze(-1))
            if with_entropy:
                p = log_p.exp_()
                torch.sum(torch.special.entr(p, out=p), dim=-1, out=entropy[rows])  # entr = -p log p
        lse.sub_(out)  # logsumexp(z) = z[tok] - log_p[tok], kept for the backward
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy)
        ctx.head, ctx.chunk_size, ctx.dtype = head, chunk_size, dtype
        ctx.set_materialize_grads(False)  # an unused output gets None: skip its maths
        if with_entropy:
            return out, entropy
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_lp, grad_ent=None):
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        head, dtype = ctx.head, ctx.dtype
        logit_scale, softcap, temperature = head
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        N, H = hidden.shape
        V = weight.shape[0]
        in_dtype = hidden.dtype
        rows_per_tile = min(N, _FUSED_BACKWARD_ROWS)
        cols_per_tile = max(1, min(V, ctx.chunk_size * V // rows_per_tile))
        n_row_blocks = -(-N // rows_per_tile)

        n_col_blocks = -(-V // cols_per_tile)
        # grad_hidden sums over vocabulary slices, grad_weight over row blocks: in float32
        # (float64) unless the inputs already are, or there is a single term.
        h_dtype = in_dtype if (in_dtype == dtype or n_col_blocks == 1) else dtype
        w_dtype = in_dtype if (in_dtype == dtype or n_row_blocks == 1) else dtype
        device = hidden.device
        grad_hidden = torch.zeros((N, H), dtype=h_dtype, device=device) if need_hidden else None
        grad_weight = torch.zeros((V, H), dtype=w_dtype, device=device) if need_weight else None
        grad_bias = torch.zeros(V, dtype=dtype, device=device) if need_bias else None

        g_lp = grad_lp.to(dtype) if grad_lp is not None else torch.zeros(N, dtype=dtype, device=hidden.device)
        g_ent = grad_ent.to(dtype) if (grad_ent is not None and entropy is not None) else None
        neg_lse = lse.neg().unsqueeze(-1)
        # tile buffers reused by every tile: logits / grad_z, the bf16 matmul and the bf16
        # grad_z, p when the entropy has a gradient, and u = tanh(.) under a softcap
        tile_elements = rows_per_tile * cols_per_tile
        z_flat = torch.empty(tile_elements, dtype=dtype, device=device)
        mm_flat = torch.empty(tile_elements, dtype=in_dtype, device=device) if in_dtype != dtype else None
        p_flat = torch.empty(tile_elements, dtype=dtype, device=device) if g_ent is not None else None
        u_flat = torch.empty(tile_elements, dtype=dtype, device=device) if softcap is not None else None
        for rows in row_chunks(N, rows_per_tile):
            h = hidden[rows]
            tok = tokens[rows]
            lp_scale = g_lp[rows].unsqueeze(-1)
            ent_scale = g_ent[rows].unsqueeze(-1) if g_ent is not None else None
            for cols in row_chunks(V, cols_per_tile):
                w = weight[cols]
                b = bias[cols] if bias is not None else None
                n, c = h.shape[0], w.shape[0]
                u = _tile(u_flat, n, c)
                z = _logits_tile(h, w, b, head, _tile(z_flat, n, c), _tile(mm_flat, n, c), u)
                # grad_z'' = g_lp (onehot - p) - g_ent p (log p + H)
                if ent_scale is None:
                    p = z.add_(neg_lse[rows]).exp_()
                    grad_z = p.mul_(lp_scale.neg())
                else:
                    log_p = z.clamp_(min=torch.finfo(dtype).min).add_(neg_lse[rows])
                    p = torch.exp(log_p, out=_tile(p_flat, n, c))
                    grad_z = log_p.add_(entropy[rows].unsqueeze(-1)).mul_(ent_scale).add_(lp_scale).mul_(p).neg_()
                # + g_lp at the target token, for the rows whose target is in this slice
                local = tok - cols.start
                in_tile = (local >= 0) & (local < grad_z.shape[1])
                grad_z.scatter_add_(-1, local.clamp(0, grad_z.shape[1] - 1).unsqueeze(-1),
                                    torch.where(in_tile.unsqueeze(-1), lp_scale, 0.0))
                # grad_z = grad_z'' * d z'' / d z
                if u is not None:
                    grad_z.addcmul_(grad_z, u.mul_(u), value=-1.0)  # * (1 - tanh**2)
                factor = logit_scale / temperature
                if factor != 1.0:
                    grad_z.mul_(factor)
                if need_bias:
                    grad_bias[cols] += grad_z.sum(0)
                gz = grad_z if mm_flat is None else _tile(mm_flat, n, c).copy_(grad_z)
                if need_hidden:
                    if grad_hidden.dtype == in_dtype:
                        grad_hidden[rows].addmm_(gz, w)
                    else:
                        grad_hidden[rows] += gz @ w
                if need_weight:
                    if grad_weight.dtype == in_dtype:
                        grad_weight[cols].addmm_(gz.t(), h)
                    else:
                        grad_weight[cols] += gz.t() @ h
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(in_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


@batch_args
def fused_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float | None = None,
    softcap: float | None = None,
    chunk_size: int | None = None,
    return_entropy: bool = False,
):
    """Token log-probs straight from the last hidden states and the LM-head weight.

    With the head's logits ``z = hidden @ weight.T + bias``, the head's transform of them,
    the logits the model returns,

    ``z' = softcap * tanh(logit_scale * z / softcap)``  (``z' = logit_scale * z`` when
    ``softcap`` is None),

    and ``z'' = z' / temperature``, all computed a chunk at a time:

    ``log_probs[b, t] = z''[b, t, tokens[b, t]] - logsumexp_v z''[b, t, v]``

    and, with ``return_entropy=True``, ``entropy[b, t] = -sum_v p_v log p_v`` where
    ``p = softmax(z''[b, t])``. Gradients reach ``hidden``, ``weight`` and ``bias``, from
    the log-probs and from the entropy (``d entropy / d z''_v = -p_v (log p_v + entropy)``),
    through ``d z'' / d z = logit_scale * (1 - tanh(logit_scale * z / softcap)**2) /
    temperature``.

    The transforms of the causal LMs in Hugging Face transformers, in this form
    (``torchforge.loop.head_transform`` reads them from a model):

    - Gemma 2 / 3 / 3n, VaultGemma, nanochat: ``cap * tanh(z / cap)``: ``softcap =
      final_logit_softcapping``; RecurrentGemma the same with ``logits_soft_cap``.
    - Granite (and its MoE / hybrid variants): ``z / logits_scaling``: ``logit_scale =
      1 / logits_scaling``; MiniCPM3 divides the hidden states by it, the same for a head
      without bias.
    - Cohere / Cohere2: ``z * logit_scale``; Falcon-H1: ``z * lm_head_multiplier``.
    - a scale then a cap (``output_multiplier`` then ``final_logit_softcapping``):
      ``softcap * tanh(output_multiplier * z / softcap)``.

    Args:
        hidden: [B, T, H] float last hidden states (the LM head's input).
        weight: [V, H] LM-head weight, same dtype as ``hidden``.
        tokens: [B, T] integer token ids in ``[0, V)``.
        bias: optional [V] LM-head bias, same dtype as ``hidden``.
        temperature: > 0; the transformed logits are divided by it, as in sampling.
        logit_scale: > 0 or None (1): the head's multiplier of its logits, applied first.
        softcap: > 0 or None (no cap): the head's tanh soft cap, applied after
            ``logit_scale``.
        chunk_size: rows (positions) per chunk of the forward; the backward uses tiles
            of the same number of logits, ``chunk_size * V``. Default about 8M logits per
            chunk (``FUSED_CHUNK_ELEMENTS // V``). The result does not depend on it.
        return_entropy: also return the entropy of ``p`` at every position.

    Returns:
        [B, T] float32 log-probs (float64 for float64 inputs); with ``return_entropy``, a
        tuple ``(log_probs, entropy)`` of two [B, T] tensors.

    Example:
        >>> import torch
        >>> # weight rows (0,) and (1,), hidden (log 3,): logits (0, log 3), p = (1/4, 3/4)
        >>> hidden = torch.tensor([[[math.log(3.0)]]])
        >>> weight = torch.tensor([[0.0], [1.0]])
        >>> fused_token_log_probs(hidden, weight, torch.tensor([[1]]))
        tensor([[-0.2877]])
        >>> # a soft cap of 30 at logits (0, 60): z' = (0, 30 tanh 2) = (0, 28.92)
        >>> fused_token_log_probs(torch.tensor([[[60.0]]]), weight, torch.tensor([[0]]), softcap=30.0)
        tensor([[-28.9208]])

    References:
        Chunked cross-entropy that never materializes the logits: Wijmans et al., "Cut
        your losses in large-vocabulary language models", https://arxiv.org/abs/2411.09009;
        Hsu et al., "Liger Kernel", https://arxiv.org/abs/2410.10989. Logit soft-capping:
        Gemma Team, "Gemma 2", https://arxiv.org/abs/2408.00118

    Note:
        The logits are computed twice (forward, and again in the backward): one extra
        LM-head matmul buys memory that no longer grows with B * T * V. Liger's fused
        linear cross-entropy instead computes the gradients inside the forward, which
        needs a scalar loss; here the output is per token, so its gradient is only known
        in the backward. bf16 inputs: matmuls run in bf16, the transform and the softmax
        maths in float32 per tile (a bf16 model rounds its transformed logits to bf16;
        this does not), and gradients that are sums over tiles are accumulated in
        float32. Memory: a few tile buffers of ``chunk_size * V`` logits (one more under
        a softcap; allocated once per call and reused by every tile), the [B, T]
        logsumexp and entropy, and for bf16 inputs with more than ``_FUSED_BACKWARD_ROWS``
        (4096) positions one float32 [V, H] accumulator for the weight gradient.
        Gradients are computed only for the inputs that require them (a frozen head costs
        no weight-gradient matmul).
    """
    fn = "fused_token_log_probs"
    check_tensor(fn, "hidden", hidden, ndim=3)
    check_float(fn, "hidden", hidden)
    check_tensor(fn, "weight", weight, ndim=2)
    check_float(fn, "weight", weight)
    B, T, H = hidden.shape
    if weight.shape[1] != H:
        raise ShapeError(
            f"{fn}: weight has shape {shape_str(weight)} but hidden has shape {shape_str(hidden)}; "
            f"expected (V, {H})"
        )
    _check_vocab(fn, "weight", weight, 0)
    V = weight.shape[0]
    tensors = {"weight": weight}
    if bias is not None:
        check_tensor(fn, "bias", bias, ndim=1)
        check_float(fn, "bias", bias)
        if bias.shape[0] != V:
            raise ShapeError(
                f"{fn}: bias has shape {shape_str(bias)} but weight has shape {shape_str(weight)}; "
                f"expected ({V},)"
            )
        tensors["bias"] = bias
    for name, x in tensors.items():
        if x.dtype != hidden.dtype:
            raise DTypeError(f"{fn}: {name} has dtype {x.dtype} but hidden has dtype {hidden.dtype}; expected the same dtype")
        if x.device != hidden.device:
            raise InvalidArgumentError(f"{fn}: {name} is on {x.device} but hidden is on {hidden.device}; expected the same device")
    _check_tokens(fn, tokens, hidden.shape[:-1], f"hidden has shape {shape_str(hidden)}", V)
    if tokens.device != hidden.device:
        raise InvalidArgumentError(
            f"{fn}: tokens is on {tokens.device} but hidden is on {hidden.device}; expected the same device"
        )
    temperature = check_temperature(fn, temperature)
    logit_scale, softcap = _check_head_transform(fn, logit_scale, softcap)
    chunk_size = _chunk_rows(fn, chunk_size, V)
    if not isinstance(return_entropy, bool):
        raise InvalidArgumentError(f"{fn}: return_entropy must be a bool, got {return_entropy!r}")

    dtype = _compute_dtype(hidden.dtype)
    result = _FusedTokenLogProbs.apply(
        hidden.reshape(B * T, H), weight, bias, tokens.reshape(B * T).long(),
        (logit_scale, softcap, temperature), chunk_size, return_entropy, dtype,
    )
    if return_entropy:
        log_probs, entropy = result
        return log_probs.view(B, T), entropy.view(B, T)
    return result.view(B, T)
