"""Wide-ResNet (Zagoruyko & Komodakis 2016), the convnet of Alpa's benchmark.

A ResNet of bottleneck blocks (He et al. 2016; the stride sits in the 3x3 conv) whose
width is scaled two ways, as in Alpa's suite: `channels` C sets the stem's output and
stage i's bottleneck width C * 2^i, and the width factor W widens each block's 3x3 conv
to C * 2^i * W output channels; a block's output has 4 C 2^i channels. With 224 x 224
images and 1024 classes this reproduces Alpa's sizes (C=160, W=2, 50 layers: 0.25B
parameters ... C=320, W=16, 101 layers: 12.6B).

Normalisation: GroupNorm (Wu & He 2018) after every conv, not BatchNorm. BatchNorm in
training mode normalises each sample with statistics of the whole batch, so the step
would (a) carry running averages as mutable state beside (params, opt_state) and (b)
change its result with the way a plan cuts the batch into micro-batches; GroupNorm
keeps the loss a mean of per-sample terms, so every data-parallel or pipelined plan of
the step computes what one device computes. The cost is what Alpa's BatchNorm adds: an
all-reduce of 2 x channels statistics per norm under data parallelism, which we omit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autopar.model_zoo.train_step import abstract_setup, concrete_setup, cross_entropy

# bottleneck blocks per stage, by depth (3 convs per block + stem + classifier)
STAGE_SIZES = {14: (1, 1, 1, 1), 26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
IMAGE_CHANNELS = 3


@dataclass(frozen=True)
class WResNetConfig:
    image_size: int = 32
    num_classes: int = 10
    layers: int = 50              # depth, a key of STAGE_SIZES
    channels: int = 16            # C: stem output; stage i's bottleneck width is C * 2^i
    width: int = 2                # W: the 3x3 conv of stage i has C * 2^i * W output channels
    norm_groups: int = 8          # GroupNorm groups; divides C
    batch: int = 8
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        if self.layers not in STAGE_SIZES:
            raise ValueError(f"WResNetConfig.layers={self.layers}: choose one of {sorted(STAGE_SIZES)}")
        if self.channels % self.norm_groups:
            raise ValueError(f"WResNetConfig: channels={self.channels} is not a multiple of "
                             f"norm_groups={self.norm_groups}")

    def convs(self) -> list[tuple[int, int, int, int]]:
        """(kernel size, in channels, out channels, output side) of every conv, in order."""
        side = math.ceil(self.image_size / 2)                      # 7x7 stem, stride 2
        out = [(7, IMAGE_CHANNELS, self.channels, side)]
        side, cin = math.ceil(side / 2), self.channels             # 3x3 max pool, stride 2
        for i, blocks in enumerate(STAGE_SIZES[self.layers]):
            mid, cout = self.channels * 2 ** i, 4 * self.channels * 2 ** i
            for j in range(blocks):
                stride_side = math.ceil(side / 2) if i > 0 and j == 0 else side
                out += [(1, cin, mid, side), (3, mid, mid * self.width, stride_side),
                        (1, mid * self.width, cout, stride_side)]
                if j == 0:                                         # projection shortcut
                    out.append((1, cin, cout, stride_side))
                side, cin = stride_side, cout
        return out

    @property
    def num_params(self) -> int:
        """Conv kernels (no biases) + a GroupNorm scale and bias per conv output + the classifier."""
        convs = self.convs()
        final = convs[-1][2]
        return sum(k * k * ci * co + 2 * co for k, ci, co, _ in convs) + final * self.num_classes + self.num_classes

    @property
    def train_flops(self) -> float:
        """Conv + classifier FLOPs (2 per multiply-add) of one train step, forward + backward.

        Forward: 2 x batch x side^2 x k^2 x C_in x C_out per conv, 2 x batch x C x classes for
        the classifier. The backward pass doubles each, except the stem, whose input (the
        image) takes no gradient: train = 3 x forward - stem forward.
        """
        convs = [2 * self.batch * side * side * k * k * ci * co for k, ci, co, side in self.convs()]
        forward = sum(convs) + 2 * self.batch * self.convs()[-1][2] * self.num_classes
        return float(3 * forward - convs[0])


class Bottleneck(nn.Module):
    """1x1 conv to `mid`, 3x3 conv (stride) to mid * width, 1x1 conv to 4 * mid; projected shortcut."""

    mid: int
    strides: int
    cfg: WResNetConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        conv = lambda features, kernel, strides=1, name=None: nn.Conv(
            features, (kernel, kernel), (strides, strides), use_bias=False, dtype=c.dtype, name=name)
        norm = lambda name=None: nn.GroupNorm(num_groups=c.norm_groups, dtype=c.dtype, name=name)
        y = nn.relu(norm()(conv(self.mid, 1)(x)))
        y = nn.relu(norm()(conv(self.mid * c.width, 3, self.strides)(y)))
        y = norm()(conv(4 * self.mid, 1)(y))
        if x.shape != y.shape:
            x = norm("norm_proj")(conv(4 * self.mid, 1, self.strides, "conv_proj")(x))
        return nn.relu(x + y)


class WResNet(nn.Module):
    """images [batch, side, side, 3] -> logits [batch, num_classes]."""

    cfg: WResNetConfig

    @nn.compact
    def __call__(self, images):
        c = self.cfg
        x = nn.Conv(c.channels, (7, 7), (2, 2), use_bias=False, dtype=c.dtype, name="stem")(images.astype(c.dtype))
        x = nn.relu(nn.GroupNorm(num_groups=c.norm_groups, dtype=c.dtype, name="stem_norm")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(STAGE_SIZES[c.layers]):
            for j in range(blocks):
                x = Bottleneck(c.channels * 2 ** i, 2 if i > 0 and j == 0 else 1, c, name=f"stage{i}_block{j}")(x)
        return nn.Dense(c.num_classes, dtype=c.dtype, name="head")(x.mean(axis=(1, 2)))


def wresnet_loss(model: WResNet) -> Callable:
    """Softmax cross-entropy of the class logits."""
    def loss(params, batch):
        images, labels = batch
        return cross_entropy(model.apply({"params": params}, images), labels)
    return loss


def wresnet_setup(cfg: WResNetConfig, optimizer: optax.GradientTransformation | None = None, seed: int = 0):
    """(train_step, state, batch) for a Wide-ResNet config, with random images and labels."""
    model = WResNet(cfg)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    images = jax.random.normal(k1, (cfg.batch, cfg.image_size, cfg.image_size, IMAGE_CHANNELS), cfg.dtype)
    labels = jax.random.randint(k2, (cfg.batch,), 0, cfg.num_classes)
    return concrete_setup(model, wresnet_loss(model), optimizer, (images, labels), k3)


def wresnet_abstract_setup(cfg: WResNetConfig, optimizer: optax.GradientTransformation | None = None):
    """(train_step, state, batch) as ShapeDtypeStructs: plan a model too big to materialise."""
    model = WResNet(cfg)
    images = jax.ShapeDtypeStruct((cfg.batch, cfg.image_size, cfg.image_size, IMAGE_CHANNELS), cfg.dtype)
    labels = jax.ShapeDtypeStruct((cfg.batch,), jnp.int32)
    return abstract_setup(model, wresnet_loss(model), optimizer, (images, labels))
