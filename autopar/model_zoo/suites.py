"""Alpa's weak-scaling benchmark suites (OSDI'22, Table 4 and Fig. 7) as data: one tuple per family.

Model sizes grow with the device count, 1 to 64 A100s (8 per host). Sources:
- GPT-3: Alpa Table 4 (0.35B ... 39B), seq 1024, vocab 51200, global batch 1024, FP16.
- GShard MoE: Alpa Table 4 (0.38B ... 70B, global batch 1024, FP16); the shapes per size
  are those of Alpa's benchmark scripts (alpa-projects/alpa, benchmark/alpa/suite_manual_moe.py
  `moe_specs`, used by suite_auto_moe.py): seq 1024, vocab 32000, 16 heads, expert group
  2048 tokens; FFN width 8 x hidden, tied embedding and every other layer MoE as counted by
  `compute_moe_parameter_count` in benchmark/alpa/util.py. Not found in the paper or the
  scripts, so chosen here: capacity factor 2 (GShard's 2S/E slots per expert) and the
  load-balancing weight 0.01.
- Wide-ResNet: Alpa Table 4 (0.25B ... 13B, global batch 1536, FP32); shapes per size from
  benchmark/alpa/suite_wresnet.py `wresnet_specs`: 224 x 224 images, (depth, C, W) =
  (50, 160, 2) ... (101, 320, 16). 1024 classes as in Alpa's benchmark. Alpa's 64-GPU runs
  used a global batch of 1520 (38 micro-batches); we keep 1536 throughout.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from autopar.model_zoo.gpt import GPTConfig
from autopar.model_zoo.moe import MoEConfig
from autopar.model_zoo.wresnet import WResNetConfig


@dataclass(frozen=True)
class BenchmarkCase:
    """One point of a weak-scaling curve: a named model config and the devices it runs on."""

    name: str
    model: GPTConfig | MoEConfig | WResNetConfig
    devices: int


def _gpt(name: str, layers: int, hidden: int, heads: int, devices: int) -> BenchmarkCase:
    return BenchmarkCase(name, GPTConfig(vocab=51200, seq=1024, hidden=hidden, heads=heads, layers=layers,
                                         batch=1024, dtype=jnp.float16), devices)


def _moe(name: str, hidden: int, layers: int, experts: int, devices: int) -> BenchmarkCase:
    return BenchmarkCase(name, MoEConfig(vocab=32000, seq=1024, hidden=hidden, heads=16, layers=layers,
                                         experts=experts, expert_group_size=2048, capacity_factor=2.0,
                                         ffn_factor=8, batch=1024, dtype=jnp.float16), devices)


def _wresnet(name: str, layers: int, channels: int, width: int, devices: int) -> BenchmarkCase:
    return BenchmarkCase(name, WResNetConfig(image_size=224, num_classes=1024, layers=layers, channels=channels,
                                             width=width, norm_groups=32, batch=1536, dtype=jnp.float32), devices)


#                  name        layers hidden heads devices
GPT_SUITE = (_gpt("GPT-350M", 24, 1024, 16, 1), _gpt("GPT-1.3B", 24, 2048, 32, 4),
             _gpt("GPT-2.6B", 32, 2560, 32, 8), _gpt("GPT-6.7B", 32, 4096, 32, 16),
             _gpt("GPT-15B", 48, 5120, 40, 32), _gpt("GPT-39B", 48, 8192, 64, 64))

#                  name        hidden layers experts devices
MOE_SUITE = (_moe("MoE-380M", 768, 8, 8, 1), _moe("MoE-1.3B", 768, 16, 16, 4),
             _moe("MoE-2.4B", 1024, 16, 16, 8), _moe("MoE-10B", 1536, 16, 32, 16),
             _moe("MoE-27B", 2048, 16, 48, 32), _moe("MoE-70B", 2048, 32, 64, 64))

#                          name            layers channels width devices
WRESNET_SUITE = (_wresnet("WResNet-250M", 50, 160, 2, 1), _wresnet("WResNet-1B", 50, 320, 2, 4),
                 _wresnet("WResNet-2B", 50, 448, 2, 8), _wresnet("WResNet-4B", 50, 640, 2, 16),
                 _wresnet("WResNet-6.8B", 50, 320, 16, 32), _wresnet("WResNet-13B", 101, 320, 16, 64))
