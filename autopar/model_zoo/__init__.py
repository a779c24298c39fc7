"""Built-in model families (flax.linen) and their train steps, for the demo, the CLI and benchmarks:
GPT, GShard MoE and Wide-ResNet, and Alpa's weak-scaling suites of each (docs/models.md)."""
from autopar.model_zoo.gpt import GPT, Block, GPTConfig, gpt_abstract_setup, gpt_loss, gpt_setup
from autopar.model_zoo.moe import MoEConfig, MoELM, moe_abstract_setup, moe_loss, moe_setup, top2_routing
from autopar.model_zoo.suites import GPT_SUITE, MOE_SUITE, WRESNET_SUITE, BenchmarkCase
from autopar.model_zoo.train_step import make_train_step
from autopar.model_zoo.wresnet import WResNet, WResNetConfig, wresnet_abstract_setup, wresnet_loss, wresnet_setup

__all__ = [
    "GPT", "Block", "GPTConfig", "gpt_abstract_setup", "gpt_loss", "gpt_setup", "make_train_step",
    "MoEConfig", "MoELM", "moe_abstract_setup", "moe_loss", "moe_setup", "top2_routing",
    "WResNet", "WResNetConfig", "wresnet_abstract_setup", "wresnet_loss", "wresnet_setup",
    "BenchmarkCase", "GPT_SUITE", "MOE_SUITE", "WRESNET_SUITE",
]
