"""Stand-ins for the search policies' tests."""


class TrainedLookingModel:
    """Looks trained to `EvolutionarySearch` (so it evolves and ranks); tests patch the scores in."""

    n_samples = 100

    def update(self, *a) -> None:
        pass
