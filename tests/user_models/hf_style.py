"""A GPT-2-like flax.linen LM written the way Hugging Face's Flax models are (``FlaxGPT2Block``,
``FlaxGPT2BlockCollection``: ``setup`` modules, blocks named ``"0"``, ``"1"``... in a Python
loop, tuple outputs, a ``gradient_checkpointing`` switch that wraps each block in
``flax.linen.partitioning.remat(Block, static_argnums=(2, 3, 4))`` with no policy: the block's
``deterministic``, ``init_cache`` and ``output_attentions``, counted after ``self``), knowing
nothing of remat-kit. No code of Hugging Face's is
copied; only the way the remat is called is reproduced. Its user cannot hand a policy to the
blocks: :func:`remat_kit.inject_policy` does."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import partitioning as nn_partitioning

remat = nn_partitioning.remat  # bound at import, as the library does


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 64
    n_embd: int = 32
    n_head: int = 2
    n_layer: int = 2
    n_positions: int = 32


class FlaxAttention(nn.Module):
    config: Config

    def setup(self):
        self.c_attn = nn.Dense(3 * self.config.n_embd)
        self.c_proj = nn.Dense(self.config.n_embd)

    def __call__(
        self, hidden_states, attention_mask=None, deterministic=True, output_attentions=False
    ):
        b, s, d = hidden_states.shape
        h = self.config.n_head
        q, k, v = jnp.split(self.c_attn(hidden_states), 3, axis=-1)
        q, k, v = (t.reshape(b, s, h, d // h) for t in (q, k, v))
        mask = nn.make_causal_mask(jnp.ones((b, s)), dtype=bool)
        weights = nn.dot_product_attention_weights(q, k, mask=mask, deterministic=deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
        out = self.c_proj(out)
        return (out, weights) if output_attentions else (out,)


class FlaxMLP(nn.Module):
    config: Config

    def setup(self):
        self.c_fc = nn.Dense(4 * self.config.n_embd)
        self.c_proj = nn.Dense(self.config.n_embd)

    def __call__(self, hidden_states, deterministic=True):
        return self.c_proj(nn.gelu(self.c_fc(hidden_states)))


class FlaxBlock(nn.Module):
    config: Config

    def setup(self):
        self.ln_1 = nn.LayerNorm()
        self.attn = FlaxAttention(self.config)
        self.ln_2 = nn.LayerNorm()
        self.mlp = FlaxMLP(self.config)

    def __call__(
        self, hidden_states, attention_mask=None, deterministic: bool = True,
        init_cache: bool = False, output_attentions: bool = False,
    ):  # fmt: skip
        outputs = self.attn(
            self.ln_1(hidden_states), attention_mask, deterministic, output_attentions
        )
        hidden_states = hidden_states + outputs[0]
        hidden_states = hidden_states + self.mlp(self.ln_2(hidden_states), deterministic)
        return (hidden_states,) + outputs[1:]


class FlaxBlockCollection(nn.Module):
    config: Config
    gradient_checkpointing: bool = False

    def setup(self):
        if self.gradient_checkpointing:
            block = remat(FlaxBlock, static_argnums=(2, 3, 4))
        else:
            block = FlaxBlock
        self.blocks = [block(self.config, name=str(i)) for i in range(self.config.n_layer)]

    def __call__(self, hidden_states, attention_mask=None, deterministic=True, init_cache=False,
                 output_attentions=False):  # fmt: skip
        for block in self.blocks:
            hidden_states = block(
                hidden_states, attention_mask, deterministic, init_cache, output_attentions
            )[0]
        return hidden_states


class FlaxLMModule(nn.Module):
    config: Config
    gradient_checkpointing: bool = False

    def setup(self):
        c = self.config
        self.wte = nn.Embed(c.vocab_size, c.n_embd)
        self.wpe = nn.Embed(c.n_positions, c.n_embd)
        self.h = FlaxBlockCollection(c, gradient_checkpointing=self.gradient_checkpointing)
        self.ln_f = nn.LayerNorm()

    def __call__(self, input_ids, deterministic=True):
        positions = jnp.arange(input_ids.shape[-1])[None]
        x = self.wte(input_ids) + self.wpe(positions)
        x = self.ln_f(self.h(x, None, deterministic))
        return self.wte.attend(x)  # tied head: logits [batch, seq, vocab]


def loss_fn(model: FlaxLMModule, apply=None):
    """``loss(params, tokens)``: next-token cross-entropy of ``model`` (no policy anywhere);
    ``apply``: ``model.apply`` or a wrapper of it (``remat_kit.tag_linen``)."""
    apply = apply or model.apply

    def loss(params, tokens):
        logits = apply({"params": params}, tokens[:, :-1], deterministic=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def arguments(batch: int = 2, seq: int = 17, config: Config = Config()):
    """The model with ``gradient_checkpointing=True``, its params and tokens [batch, seq],
    abstract (``jax.ShapeDtypeStruct``: nothing computed)."""
    model = FlaxLMModule(config, gradient_checkpointing=True)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    inputs = jax.ShapeDtypeStruct((batch, seq - 1), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), inputs)["params"]
    return model, params, tokens


def program_as_is():
    """``--model tests/user_models/hf_style.py:program_as_is``: the factory a user writes first,
    which cannot hand the policy to the blocks (the tools refuse it, naming inject_policy)."""
    from remat_kit import Program

    model, params, tokens = arguments()
    loss = loss_fn(model)
    return Program.from_loss(lambda policy: loss, params, tokens, name="hf-as-is")


def program():
    """``--model tests/user_models/hf_style.py:program``: the blocks' policy set by
    ``remat_kit.inject_policy``."""
    from remat_kit import Program, inject_policy

    model, params, tokens = arguments()
    return Program.from_loss(inject_policy(loss_fn(model)), params, tokens, name="hf-style")
