"""
synthetic.py: the embedded synthetic task, generated on the fly: running products in a permutation group, with
each answer written after a gap of g elements, so that it needs g compositions (depth) to predict.

    python data.py --source synthetic --max-gap 4 --show 3     # a few sequences, decoded

The layout, why a gap, why this group and the loss floor: docs/training.md#the-synthetic-task. data.py's
BatchLoader cuts its sequences into batches like token shards; train.py scores the answers with answer_metrics.
"""
import itertools
import math

import numpy as np
import torch

from depthbench.files.common import VAL_SEED

SPLITS = {"train": 0, "val": 1}  # the split's number goes into the synthetic RNG seed (and names the loader's splits)


class SyntheticTask:
    """Running products in the permutation group S4 (or S3, S5), with the answer written after a gap
    (docs/training.md#the-synthetic-task: the layout, why a gap, why this group, the loss floor). A sequence is

        = a0 | e e = a1 | e = a2 | e e e e = a3 | ...

    (the "|" are not tokens): "=", a random start a0, then segments of g uniform random elements (g uniform
    in 1..max_gap), "=" and the answer a_j = a_{j-1}·e_1·…·e_g, where p·q means "apply p, then q":
    (p·q)[i] = q[p[i]]. Tokens 0..|G|-1 are the permutations of 0..n-1 in lexicographic order (0: the
    identity) and |G| is "=" (vocab 25 for S4, 121 for S5). The answer after a gap of g needs g
    compositions, so g is its difficulty level.
    """

    def __init__(self, max_gap=4, group="s4", answers_only=False):
        if max_gap < 1 or group not in ("s3", "s4", "s5"):
            raise ValueError(f"synthetic task needs max_gap >= 1 and group s3|s4|s5, got {max_gap}, {group!r}")
        self.max_gap, self.group, self.answers_only = max_gap, group, answers_only
        self.elements = list(itertools.permutations(range(int(group[1]))))
        index = {p: i for i, p in enumerate(self.elements)}
        # mul[a][b] = a·b, as a list of lists because the generator indexes it one token at a time
        self.mul = [[index[tuple(b[i] for i in a)] for b in self.elements] for a in self.elements]
        self.eq = len(self.elements)
        # answers_only: answers get ids of their own (eq+1+a), no "=" precedes them, and only answers are
        # targets (the loader writes -1, the ignored target, everywhere else): no gradient is spent on the
        # random elements, and the answer is predicted where the last element of its gap is read
        self.answer_offset = self.eq + 1 if answers_only else 0
        self.vocab_size = self.eq + 1 + (self.eq if answers_only else 0)

    def sequence(self, split, index, length, seed=VAL_SEED):
        """Sequence number `index` of a split: (tokens, levels), two int lists of `length`;
        levels[t] = g when token t is an answer written after a gap of g, else -1. The RNG is seeded
        by (seed, split, index): train and val never share a stream, and any sequence can be rebuilt
        from its index alone."""
        rng = np.random.default_rng([seed, SPLITS[split], index])
        gaps = rng.integers(1, self.max_gap + 1, size=length).tolist()
        elems = iter(rng.integers(0, self.eq, size=length + self.max_gap).tolist())
        state = next(elems)
        tokens, levels = [self.eq, state], [-1, -1]
        for g in gaps:
            if len(tokens) >= length:
                break
            for _ in range(g):
                e = next(elems)
                state = self.mul[state][e]
                tokens.append(e)
            levels += [-1] * g
            tokens += [state + self.answer_offset] if self.answers_only else [self.eq, state]
            levels += [g] if self.answers_only else [-1, g]
        return tokens[:length], levels[:length]

    def loss_floor(self, seq_len=None):
        """The least mean cross-entropy (nats per target) any model can reach on all targets of a
        (B, seq_len) batch. seq_len=None gives the long-sequence limit (ln k + (k+1)/2·ln|G|) / ((k+5)/2),
        2.0737 for S4 and k = 4. Exact: it follows the probability of each "what came last" state through
        the seq_len positions."""
        k, lnG = self.max_gap, math.log(self.eq)
        if seq_len is None:
            return (math.log(k) + (k + 1) / 2 * lnG) / ((k + 5) / 2)
        # target 0 is a0 (uniform). Then the states: 0 = after a0 or an answer (an element is next:
        # ln|G|), j = 1..k = j elements into a segment, k+1 = after a closing "=" (the answer is next: 0)
        hazard = [None] + [1 / (k - j + 1) for j in range(1, k + 1)]  # P("=" next | j elements so far)
        cost = [lnG] + [-h * math.log(h) - (1 - h) * math.log((1 - h) / self.eq) if h < 1 else 0.0
                        for h in hazard[1:]] + [0.0]
        p, total = [1.0] + [0.0] * (k + 1), lnG
        for _ in range(seq_len - 1):
            total += sum(pi * ci for pi, ci in zip(p, cost))
            nxt = [p[k + 1]] + [0.0] * (k + 1)  # an answer is followed by the next segment
            nxt[1] += p[0]
            for j in range(1, k + 1):
                nxt[k + 1] += p[j] * hazard[j]
                if j < k:
                    nxt[j + 1] += p[j] * (1 - hazard[j])
            p = nxt
        return total / seq_len

    def decode(self, tokens, levels):
        """Readable text: elements in one-line notation, answers as 'g2:3021 |'."""
        words = []
        for i, (t, level) in enumerate(zip(tokens, levels)):
            element = t - self.answer_offset if t > self.eq else t  # answers_only: answers have ids of their own
            word = "=" if t == self.eq else "".join(map(str, self.elements[element]))
            if level > 0:
                word = f"g{level}:{word} |"
            words.append(word + " |" if i == 1 else word)  # token 1 is a0, the start
        return " ".join(words)


def answer_metrics(logits, y, level, max_gap):
    """The synthetic task's metrics that count: answers only, per level. Returns a (max_gap, 3) tensor
    whose row g-1 holds [summed cross-entropy, correct argmax predictions, count] over targets of
    level g. They are sums, so they add up over micro-steps and ranks (all_reduce); then
    loss = m[:, 0] / m[:, 2] and accuracy = m[:, 1] / m[:, 2]."""
    logits, y, level = logits.flatten(0, 1).float(), y.flatten(), level.flatten().to(y.device)
    keep = level > 0
    ce = torch.nn.functional.cross_entropy(logits[keep], y[keep], reduction="none")
    correct = (logits[keep].argmax(-1) == y[keep]).float()
    sums = torch.zeros(max_gap, 3, device=logits.device)
    return sums.index_add_(0, level[keep] - 1, torch.stack([ce, correct, torch.ones_like(ce)], 1))


def verdict(per_level, chance, n_layer):
    """One line on what a synthetic run learnt: how many compositions per answer (gaps) it solves."""
    acc = {int(g): m["acc"] for g, m in per_level.items()}
    groups = {"solves answers after a gap of": [g for g in acc if acc[g] >= 0.9],
              "partly": [g for g in acc if 2 * chance <= acc[g] < 0.9],
              "not learnt for": [g for g in acc if acc[g] < 2 * chance]}
    if not (groups["solves answers after a gap of"] or groups["partly"]):
        return (f"result: answers below twice chance ({chance:.1%}) for every gap: this model has not learnt to "
                f"compose permutations yet (longer --steps, another --seed or --lr)")
    parts = [what + " " + ", ".join(f"{g} ({acc[g]:.0%})" for g in gs) for what, gs in groups.items() if gs]
    return (f"result: L={n_layer} " + "; ".join(parts) + f" (chance {chance:.1%}). A gap of g needs "
            f"g compositions of permutations: which gaps a design solves at which depth is the mini suite's probe")
