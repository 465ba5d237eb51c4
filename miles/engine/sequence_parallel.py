"""Sequence-parallel engines: one engine = N processes, each holding the whole DiT, each computing 1/N of the
image/video tokens of every forward (Ulysses).

Every rank runs the same forward on the same inputs. The family's `SequenceParallelLayout` (miles/models/base.py)
says where the token sequence is split and gathered (a diffusers context-parallel plan: the model's own
`_cp_plan` where diffusers has one, e.g. Wan; the family's own otherwise, e.g. SD3) and which attention layers
mix tokens. Between the split and the gather each rank holds its contiguous chunk of the tokens with all
channels; everything token-wise (projections, norms, MLPs, modulation) runs on that chunk. Attention needs
every token: an all-to-all turns the local [B, S/N, H, D] queries/keys/values into [B, S, H/N, D] (all
tokens, this rank's heads), attention runs per head, and a second all-to-all turns the output back.

- joint attention (SD3's MMDiT, `JointAttnProcessor2_0` semantics): the text tokens are replicated on every
  rank; each rank takes its H/N heads of their queries/keys/values, so each head attends over [image, text]
  exactly as one process would; the text output is all-gathered over the heads (every rank then holds the
  whole text stream, which the next block needs).
- self attention (Wan's `attn1`, `WanAttnProcessor` semantics): the rotary table is split with the tokens by
  the plan. Cross-attention to the text needs no exchange (local queries against all text keys) and keeps
  the model's own processor.

Communication goes through the engine's private group (cfg_parallel.py: gloo on CPU, NCCL on GPU; no default
process group, no DeviceMesh), so an engine process may also belong to other groups (weight broadcast).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from miles.models.base import SequenceParallelLayout
from miles.utils.errors import MilesUserError

FLAG = "--rollout-num-gpus-per-engine"


class UlyssesComm:
    """The collectives of one sequence-parallel group (a cfg_parallel `_Group`)."""

    def __init__(self, group) -> None:
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size

    @staticmethod
    def _wait(work) -> None:
        # NCCL: wait() orders the current stream after the collective, and only kernels on that stream read the
        # result (no host synchronisation inside the forward); gloo: it blocks until the data arrived
        work.wait()

    def all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        """chunks [N, ...]: chunk j goes to rank j; returns [N, ...] whose chunk i came from rank i."""
        chunks = chunks.contiguous()
        out = torch.empty_like(chunks)
        options = dist.AllToAllOptions()
        options.timeout = self.group.timeout
        self._wait(self.group.backend.alltoall_base(out, chunks, [], [], options))
        return out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[...] on every rank -> [N, ...], rank i's tensor at index i."""
        tensor = tensor.contiguous()
        out = torch.empty((self.world_size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        self._wait(self.group.backend._allgather_base(out, tensor))
        return out.view(self.world_size, *tensor.shape)

    # ---- the Ulysses exchanges, on [B, S, H, D] ----------------------------------------------------------
    def tokens_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S/N, H, D] (this rank's tokens, all heads) -> [B, S, H/N, D] (all tokens, this rank's heads)."""
        batch, tokens, heads, dim = x.shape
        n = self.world_size
        chunks = x.reshape(batch, tokens, n, heads // n, dim).permute(2, 0, 1, 3, 4)  # [dest rank, B, S/N, h, D]
        received = self.all_to_all(chunks)  # [source rank = token chunk, B, S/N, h, D]
        return received.permute(1, 0, 2, 3, 4).reshape(batch, n * tokens, heads // n, dim)

    def heads_to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse: [B, S, H/N, D] -> [B, S/N, H, D]."""
        batch, tokens, heads, dim = x.shape
        n = self.world_size
        chunks = x.reshape(batch, n, tokens // n, heads, dim).permute(1, 0, 2, 3, 4)  # [dest = token chunk, ...]
        received = self.all_to_all(chunks)  # [source rank = head group, B, S/N, h, D]
        return received.permute(1, 2, 0, 3, 4).reshape(batch, tokens // n, n * heads, dim)

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H/N, D] (this rank's heads) -> [B, T, H, D] on every rank."""
        batch, tokens, heads, dim = x.shape
        return self.all_gather(x).permute(1, 2, 0, 3, 4).reshape(batch, tokens, self.world_size * heads, dim)

    def head_slice(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> this rank's heads [B, T, H/N, D]."""
        heads = x.shape[2] // self.world_size
        return x[:, :, self.rank * heads : (self.rank + 1) * heads]

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if x.shape[dim] % self.world_size:
            raise ValueError(f"sequence-parallel split: {x.shape[dim]} tokens (dim {dim} of {tuple(x.shape)}) do not "
                             f"divide into {self.world_size} ranks")
        return x.chunk(self.world_size, dim=dim)[self.rank].contiguous()

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(list(self.all_gather(x).unbind(0)), dim=dim)


# ---- attention processors ----------------------------------------------------------------------------------
class UlyssesJointAttnProcessor:
    """SD3's `JointAttnProcessor2_0` with the image tokens split over the ranks and the text tokens replicated."""

    def __init__(self, comm: UlyssesComm) -> None:
        self.comm = comm

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        if attention_mask is not None:
            raise NotImplementedError("sequence-parallel joint attention takes no attention mask")
        comm = self.comm
        batch, local_tokens = hidden_states.shape[:2]
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads

        def split_heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, -1, attn.heads, head_dim)

        query, key, value = split_heads(query), split_heads(key), split_heads(value)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        # [B, H, S, D] layout as the model's processor builds it, this rank's heads over all image tokens
        parts = [[comm.tokens_to_heads(x).transpose(1, 2)] for x in (query, key, value)]
        if encoder_hidden_states is not None:
            text = [split_heads(attn.add_q_proj(encoder_hidden_states)),
                    split_heads(attn.add_k_proj(encoder_hidden_states)),
                    split_heads(attn.add_v_proj(encoder_hidden_states))]
            if attn.norm_added_q is not None:
                text[0] = attn.norm_added_q(text[0])
            if attn.norm_added_k is not None:
                text[1] = attn.norm_added_k(text[1])
            for part, x in zip(parts, text):
                part.append(comm.head_slice(x).transpose(1, 2))
        query, key, value = (torch.cat(part, dim=2) for part in parts)

        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).to(query.dtype)  # [B, S + T, H/N, D]
        image_tokens = local_tokens * comm.world_size
        hidden_states = comm.heads_to_tokens(out[:, :image_tokens])  # [B, S/N, H, D]
        if encoder_hidden_states is not None:
            # one [B, S/N + T, H·D] buffer sliced in two, as the model's processor slices its [B, S + T, H·D]: a
            # 16-bit CPU linear takes another kernel for a strided input than for a contiguous one
            hidden_states = torch.cat([hidden_states, comm.gather_heads(out[:, image_tokens:])], dim=1)
        hidden_states = hidden_states.reshape(batch, -1, attn.heads * head_dim)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = hidden_states[:, :local_tokens], hidden_states[:, local_tokens:]
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is None:
            return hidden_states
        return hidden_states, encoder_hidden_states


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved (even, odd) channel pairs, Wan's convention."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out.type_as(x)


class UlyssesSelfAttnProcessor:
    """Wan's `WanAttnProcessor` for self-attention (`attn1`) with the video tokens split over the ranks."""

    def __init__(self, comm: UlyssesComm, attention_backend: Any = None) -> None:
        self.comm = comm
        self._attention_backend = attention_backend

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if encoder_hidden_states is not None or attn.add_k_proj is not None:
            raise NotImplementedError("the sequence-parallel self-attention processor got cross-attention inputs")
        comm = self.comm
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)  # across heads, token-wise: on the local tokens
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if rotary_emb is not None:  # the plan split the table with the tokens
            query, key = _rotate_interleaved(query, *rotary_emb), _rotate_interleaved(key, *rotary_emb)
        out = dispatch_attention_fn(
            comm.tokens_to_heads(query), comm.tokens_to_heads(key), comm.tokens_to_heads(value),
            attn_mask=attention_mask, dropout_p=0.0, is_causal=False, backend=self._attention_backend,
            parallel_config=None,
        )
        hidden_states = comm.heads_to_tokens(out).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden_states))


# processor class names whose semantics the two processors above reproduce
JOINT_PROCESSORS = ("JointAttnProcessor2_0",)
SELF_PROCESSORS = ("WanAttnProcessor", "WanAttnProcessor2_0")


# ---- the plan: split and gather hooks ------------------------------------------------------------------------
def _parameter_index(module: nn.Module, name: str) -> int | None:
    parameters = list(inspect.signature(module.forward).parameters)
    return parameters.index(name) if name in parameters else None


def _applies(spec, tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and (spec.expected_dims is None or tensor.dim() == spec.expected_dims)


def _install_plan(module: nn.Module, plan: Mapping[str, Any], comm: UlyssesComm) -> list:
    """Forward hooks for a diffusers context-parallel plan: `{submodule: {input name: ContextParallelInput}}`
    splits that input (or, with `split_output`, output index) along its `split_dim`; `{submodule:
    ContextParallelOutput | [ContextParallelOutput]}` gathers the output(s) along `gather_dim`. Tensors with
    other than `expected_dims` dims pass unchanged (diffusers' rule: e.g. Wan's per-sample 1-D timesteps)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    handles = []
    for path, spec in plan.items():
        target = module.get_submodule(path) if path else module
        if isinstance(spec, dict):
            inputs = {name: s for name, s in spec.items() if isinstance(s, ContextParallelInput) and not s.split_output}
            outputs = {index: s for index, s in spec.items() if isinstance(s, ContextParallelInput) and s.split_output}
            if inputs:
                positions = {name: _parameter_index(target, name) for name in inputs}

                def split_inputs(_module, args, kwargs, inputs=inputs, positions=positions):
                    args = list(args)
                    for name, s in inputs.items():
                        if name in kwargs:
                            if _applies(s, kwargs[name]):
                                kwargs[name] = comm.split(kwargs[name], s.split_dim)
                        elif positions[name] is not None and positions[name] < len(args):
                            if _applies(s, args[positions[name]]):
                                args[positions[name]] = comm.split(args[positions[name]], s.split_dim)
                    return tuple(args), kwargs

                handles.append(target.register_forward_pre_hook(split_inputs, with_kwargs=True))
            if outputs:
                def split_outputs(_module, _args, output, outputs=outputs):
                    single = isinstance(output, torch.Tensor)
                    values = [output] if single else list(output)
                    for index, s in outputs.items():
                        if _applies(s, values[index]):
                            values[index] = comm.split(values[index], s.split_dim)
                    return values[0] if single else type(output)(values)

                handles.append(target.register_forward_hook(split_outputs))
        else:
            specs = [spec] if isinstance(spec, ContextParallelOutput) else list(spec)

            def gather_outputs(_module, _args, output, specs=specs):
                single = isinstance(output, torch.Tensor)
                values = [output] if single else list(output)
                for index, s in enumerate(specs):
                    if s is not None and _applies(s, values[index]):
                        values[index] = comm.gather(values[index], s.gather_dim)
                return values[0] if single else type(output)(values)

            handles.append(target.register_forward_hook(gather_outputs))
    return handles


# ---- checks and installation --------------------------------------------------------------------------------
def sequence_parallel_layouts(family, modules: Mapping[str, nn.Module], degree: int) -> dict[str, SequenceParallelLayout]:
    """Every denoiser's layout, checked against `degree` ranks (MilesUserError naming the family otherwise)."""
    layouts = {}
    for name, module in modules.items():
        layout = family.sequence_parallel_layout(module)
        if layout is None:
            raise MilesUserError(
                f"{FLAG} {degree} (sequence-parallel engine): the {family.family!r} family has no sequence-parallel "
                f"layout for its {name!r} module ({type(module).__name__}); run it with 1 GPU per engine"
            )
        for attn in (*layout.joint_attention, *layout.self_attention):
            if attn.heads % degree:
                raise MilesUserError(
                    f"{FLAG} {degree} (sequence-parallel engine): the {family.family!r} model's attention has "
                    f"{attn.heads} heads, not divisible by {degree}; use a degree that divides {attn.heads}"
                )
        known = ((layout.joint_attention, JOINT_PROCESSORS), (layout.self_attention, SELF_PROCESSORS))
        for attentions, names in known:
            for attn in attentions:
                processor = type(attn.processor).__name__
                if processor not in names:
                    raise MilesUserError(
                        f"{FLAG} {degree} (sequence-parallel engine): the {family.family!r} model's attention uses "
                        f"{processor}, which the sequence-parallel engine cannot split (it knows {names})"
                    )
        layouts[name] = layout
    return layouts


def check_sequence_length(layout: SequenceParallelLayout, latent_shape: tuple[int, ...], degree: int) -> None:
    """Refuse (ValueError, a 400 for a request) a latent size whose token count does not split into `degree`."""
    spatial = latent_shape[-len(layout.patch_size):]
    tokens = math.prod(size // patch for size, patch in zip(spatial, layout.patch_size))
    if tokens % degree:
        raise ValueError(
            f"this output size gives {tokens} image/video tokens, which do not split over the {degree} ranks of "
            f"this sequence-parallel engine; choose a height/width/frame count whose token count divides by {degree}"
        )


def install_sequence_parallel(layouts: Mapping[str, SequenceParallelLayout], modules: Mapping[str, nn.Module],
                              comm: UlyssesComm) -> None:
    """Replace the mixing attention processors and hook the plan's splits and gathers in, on every denoiser."""
    for name, layout in layouts.items():
        for attn in layout.joint_attention:
            attn.set_processor(UlyssesJointAttnProcessor(comm))
        for attn in layout.self_attention:
            attn.set_processor(UlyssesSelfAttnProcessor(comm, getattr(attn.processor, "_attention_backend", None)))
        _install_plan(modules[name], layout.plan, comm)
