"""The rules a wavefront ordering decides by, and the sets of them the planner tries.

Pure (standard library only), data only: ordering.py plays a step out under one `Rules`;
wavefront.py plays out CANDIDATES in order and keeps the order whose simulated step ends first.
Knows nothing of samples, graphs or time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Rules:
    """How one ordering decides; every field's default is the original wavefront's choice.

    Why alternatives at all: no single rule wins everywhere once an encoder trains. Its
    backward waits for the LLM's gradients and then runs before its next forward, so the
    encoder idles when its forwards ran out and no gradient is back (the LLM should answer
    quickly: short micro-batches, the encoder's outputs spread over LLM replicas), and the step
    ends with the encoder's backward of whatever the LLM finished last (the last encoder
    micro-batches should be small). An LLM-bound step wants the opposite of some of these.
    """

    name: str
    # Assignment score (balance.assign): "seconds" keeps the busiest touched replica least
    # busy; "share" measures each section's load as a share of its work per replica, so that
    # an image also balances the encoder replicas when the LLM's load decides the seconds.
    balance: str = "seconds"
    # Johnson's producer time for one consumer replica's queue: the producer's forward, or
    # that times the consumer replicas it serves (it serves the others in between).
    shared_producer: bool = False
    # Which consumer replica a producer serves next: the one that would starve first, or the
    # one with the most consumer work still to produce (all queues end together).
    serve: str = "starving"
    # Samples that need nothing upstream fill consumer micro-batches "longest" first (a
    # balanced tail), "shortest" first (the consumer is soon free for arrivals), or short ones
    # at both ends and the longest in the "middle" (free for the first outputs, and for the
    # last ones, whose gradients the encoder's final backwards wait for).
    fill: str = "longest"
    # Fill a micro-batch that holds arrived samples with free ones (else it runs with the
    # arrived ones alone, so their gradients go back sooner).
    pad: bool = True
    # A producer micro-batch takes at most its fair share (micro_batch / consumer replicas it
    # feeds) for one consumer replica, so no consumer task holds back its gradients alone.
    spread: bool = False
    # A trainable producer's micro-batch stops growing once its backward exceeds `taper` x the
    # least free work its consumers still hold: the step's last backwards stay small.
    taper: float = 0.0
    # The producer takes, from the chosen queue, the largest job (forward + backward) the
    # consumer's buffer hides, else the one that costs the producer least over the consumer.
    fit: bool = False
    # A consumer with nothing arrived fills its next micro-batch with free samples that end
    # before the next output it knows is coming (the largest that fit first; the shortest one
    # when none fits), so an arrival does not wait behind a long free sample.
    gap: bool = False
    # A producer's micro-batch stops growing once the forwards of its samples (fixed cost,
    # padding and transfer left out: a heuristic) reach the work the hungriest consumer replica
    # it feeds still holds, counted when the decision starts (that replica then starves behind
    # no long micro-batch); at least one sample.
    prompt: bool = False

    def validate(self) -> None:
        if self.balance not in ("seconds", "share"):
            raise ValueError(f"Rules.balance must be 'seconds' or 'share', got {self.balance!r}")
        if self.serve not in ("starving", "remaining"):
            raise ValueError(f"Rules.serve must be 'starving' or 'remaining', got {self.serve!r}")
        if self.fill not in ("longest", "shortest", "middle"):
            raise ValueError(f"Rules.fill must be 'longest', 'shortest' or 'middle', got {self.fill!r}")
        if self.taper < 0:
            raise ValueError(f"Rules.taper must be >= 0, got {self.taper}")


# Tried in this order; the first ones matter most (large batches only get to try those, and the
# first two share one assignment). The set was chosen by simulation over a grid of vision -> LLM
# layouts (vision dp 1-2 -> llm dp 2-8, micro-batches 2-8, 10-90% images, frozen and trainable
# encoders, two sample distributions; tools/bench/wavefront_sim.py --worst): with FIFO it keeps
# every case of 256 and 512 samples within 5% of simulate.bound_terms' bound, where the original rules
# (every field's default) alone reached 1.31x and were up to 7% slower than FIFO. The last five
# were picked greedily, the first two fixed, from 44 rule sets scored on that grid at 128 and
# 256 samples (fewest cases above 1.05x, then the least excess over it); every one of them
# tapers a trainable encoder's last micro-batches (the step ends with their backward) but one.
CANDIDATES: tuple[Rules, ...] = (
    # The encoder's outputs spread over the LLM replicas and its queues finishing together, the
    # LLM answering images alone and keeping long text for the middle of the step, the
    # assignment balancing the encoder's replicas too: best alone over the grid and at 4096.
    Rules(name="middle-spread", balance="share", shared_producer=True, serve="remaining", fill="middle",
          pad=False, spread=True, taper=0.5),
    # The encoder takes the largest job the LLM's buffer hides (an encoder-bound step with many
    # LLM replicas per encoder replica).
    Rules(name="fit", balance="share", taper=0.5, fit=True),
    # As the first, with no LLM replica starving behind a long encoder micro-batch nor an
    # encoder output behind long text (frozen encoders with large images, mostly).
    Rules(name="middle-spread-gap-prompt", balance="share", shared_producer=True, serve="remaining",
          fill="middle", pad=False, spread=True, taper=0.5, gap=True, prompt=True),
    # Short text first and around arrivals, the encoder's work spread over the LLM replicas and
    # not tapered: few images per LLM replica, each answered at once.
    Rules(name="shortest-spread-gap", balance="share", fill="shortest", pad=False, spread=True, gap=True),
    Rules(name="middle", balance="share", serve="remaining", fill="middle", pad=False, taper=0.5),
    Rules(name="fit-spread-gap", serve="remaining", fill="middle", pad=False, spread=True, taper=0.5, fit=True,
          gap=True),
    Rules(name="fit-shortest-gap", balance="share", fill="shortest", pad=False, taper=0.5, fit=True, gap=True),
)
