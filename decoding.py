"""choose(): pick the next token from the last position's logits, as the article's server does.

Nucleus (top-p) sampling with one uniform draw a token, a temperature (0 means greedy), and an
optional repetition penalty; token i's draw is `uniform(seed, i)`, so a stream can be resumed
anywhere. `choose_batch` does the same for a batch of rows. The code lives in the package
(streaming/generation/sampling.py), which the engines use; this is the article's name for it.
"""

from streaming.generation.sampling import Draws, choose, choose_batch, uniform

__all__ = ["Draws", "choose", "choose_batch", "uniform"]
