"""Built-in model families (flax.linen) and their train steps, for the demo, the CLI and benchmarks."""
from autopar.model_zoo.gpt import GPT, Block, GPTConfig, gpt_abstract_setup, gpt_loss, gpt_setup, make_train_step

__all__ = ["GPT", "Block", "GPTConfig", "gpt_abstract_setup", "gpt_loss", "gpt_setup", "make_train_step"]
