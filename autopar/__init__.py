"""autopar: automatic parallelization of JAX train steps."""
