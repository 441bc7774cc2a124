"""Seeded random streams: client sampling from (seed, round), client RNGs from (seed, round, id).

Every random draw in a run derives from the run seed through numpy's SeedSequence with a
distinct tag per purpose, so results do not depend on which worker ran what, in which order,
or whether the run was resumed from a checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch

# Distinct first words keep the streams of different purposes independent.
_SAMPLING, _CLIENT, _MODEL_INIT = 1, 2, 3


def sample_clients(
    seed: int,
    round_index: int,
    num_clients: int,
    per_round: int,
    malicious_below: int = 0,
    redraw_majority: bool = False,
) -> np.ndarray:
    """The round's clients, drawn without replacement, in ascending id order.

    Ascending order fixes the reduction order (client-id order) for the whole engine. The cost
    is O(per_round), not O(num_clients), so a million registered clients cost nothing extra.
    With `redraw_majority`, a draw in which at least half the clients are malicious (ids below
    `malicious_below`) is replaced by a fresh one, as in the FRL paper's code.
    """
    if per_round > num_clients:
        raise ValueError(f"cannot sample {per_round} clients out of {num_clients}")
    for attempt in range(10_000):
        ids = _draw(seed, round_index, attempt, num_clients, per_round)
        malicious = int(np.searchsorted(ids, malicious_below))
        if not redraw_majority or 2 * malicious < per_round:
            return ids
    raise ValueError(
        f"could not draw {per_round} clients with fewer than half malicious "
        f"({malicious_below} of {num_clients} are malicious)"
    )


def _draw(
    seed: int, round_index: int, attempt: int, num_clients: int, per_round: int
) -> np.ndarray:
    words = [seed, _SAMPLING, round_index] + ([attempt] if attempt else [])
    rng = np.random.default_rng(np.random.SeedSequence(words))
    if per_round * 50 < num_clients:
        # Floyd's algorithm over a set: O(per_round) memory and time.
        chosen: set[int] = set()
        for upper in range(num_clients - per_round, num_clients):
            value = int(rng.integers(0, upper + 1))
            chosen.add(upper if value in chosen else value)
        ids = np.fromiter(chosen, dtype=np.int64, count=per_round)
    else:
        ids = rng.permutation(num_clients)[:per_round].astype(np.int64)
    ids.sort()
    return ids


def _torch_seed(*words: int) -> int:
    state = np.random.SeedSequence(list(words)).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])


def client_generator(seed: int, round_index: int, client_id: int) -> torch.Generator:
    """The torch Generator a client uses for everything random in its local training."""
    return torch.Generator().manual_seed(_torch_seed(seed, _CLIENT, round_index, client_id))


def client_generators(seed: int, round_index: int, client_ids) -> list[torch.Generator]:
    """`client_generator` of each of `client_ids` (a task's or a batched chunk's clients),
    their seeds derived together: numpy's SeedSequence costs ~14 us a client, a sixth of a
    batched digits client's whole round."""
    ids = np.asarray(client_ids, dtype=np.int64)
    seeds = _torch_seeds([seed, _CLIENT, round_index], ids)
    return [torch.Generator().manual_seed(s) for s in seeds]


# numpy's SeedSequence (numpy/random/bit_generator.pyx), elementwise over many entropies that
# differ in their last word: the same hash, constants and order, so the same states.
_POOL_SIZE = 4
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _XSHIFT = 0xCA01F9DD, 0x4973F715, 16
_WORD = 0xFFFFFFFF
_TOGETHER_FROM = 16  # clients: fewer are hashed one at a time (~14 us each), as fast or faster


def _torch_seeds(prefix: list[int], last: np.ndarray) -> list[int]:
    """`_torch_seed(*prefix, w)` for every w of `last` (int64), all at once. Words of 2^32
    or more take several uint32 words in SeedSequence: those entropies go one at a time, as
    do fewer than _TOGETHER_FROM."""
    words = [int(w) for w in prefix]
    one_at_a_time = (
        len(last) < _TOGETHER_FROM  # (the elementwise hash costs ~0.1 ms whatever the count)
        or any(not 0 <= w <= _WORD for w in words)
        or not 0 <= last.min()
        or last.max() > _WORD
    )
    if one_at_a_time:
        return [_torch_seed(*words, int(w)) for w in last]
    count = len(last)
    entropy = [np.full(count, w, dtype=np.uint32) for w in words] + [last.astype(np.uint32)]
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_A) & _WORD
        value = value * np.uint32(hash_const)
        return value ^ (value >> np.uint32(_XSHIFT))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = np.uint32(_MIX_MULT_L) * x - np.uint32(_MIX_MULT_R) * y
        return result ^ (result >> np.uint32(_XSHIFT))

    zeros = np.zeros(count, dtype=np.uint32)
    pool = [hashmix(entropy[i] if i < len(entropy) else zeros) for i in range(_POOL_SIZE)]
    for i_src in range(_POOL_SIZE):
        for i_dst in range(_POOL_SIZE):
            if i_src != i_dst:
                pool[i_dst] = mix(pool[i_dst], hashmix(pool[i_src]))
    for i_src in range(_POOL_SIZE, len(entropy)):
        for i_dst in range(_POOL_SIZE):
            pool[i_dst] = mix(pool[i_dst], hashmix(entropy[i_src]))
    state, hash_const = [], _INIT_B
    for i_dst in range(2):  # generate_state(2, uint32)
        value = pool[i_dst % _POOL_SIZE] ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_B) & _WORD
        value = value * np.uint32(hash_const)
        state.append(value ^ (value >> np.uint32(_XSHIFT)))
    high, low = state[0].astype(np.uint64), state[1].astype(np.uint64)
    return [int(v) for v in (high << np.uint64(32)) | low]


def client_numpy_rng(seed: int, round_index: int, client_id: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, _CLIENT, round_index, client_id, 1]))


def model_init_seed(seed: int) -> int:
    return _torch_seed(seed, _MODEL_INIT)


def attacker_pool_draw(
    seed: int, round_index: int, malicious_below: int, pool_size: int
) -> np.ndarray:
    """The attacker's pool of the round: min(pool_size, malicious_below) malicious clients
    drawn without replacement (ascending), sampled this round or not (the FRL reference code's
    `np.random.choice(n_attackers, min(n_attackers, rand_mal_clients), replace=False)`)."""
    if pool_size <= 0 or malicious_below <= 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _POOL, round_index]))
    pool = rng.choice(malicious_below, size=min(pool_size, malicious_below), replace=False)
    return np.sort(pool.astype(np.int64))


def attacker_pool(
    seed: int, round_index: int, malicious_below: int, pool_size: int, sampled: np.ndarray
) -> np.ndarray:
    """Malicious clients the attacker trains this round besides its sampled ones (ascending):
    the pool's draw less the round's sampled clients (who train anyway)."""
    draw = attacker_pool_draw(seed, round_index, malicious_below, pool_size)
    return np.setdiff1d(draw, sampled)


_POOL = 6

# Seeds handed to data generation, partitioning and the validation hold-out (plain ints, for
# numpy default_rng).
DATA, PARTITION, VALIDATION = 4, 5, 11


def purpose_seed(seed: int, purpose: int) -> int:
    return int(np.random.SeedSequence([seed, purpose]).generate_state(1, dtype=np.uint64)[0])


# The streams of the simulated-time and fault rooms and of the class-embedding methods' start.
# Their words were chosen above the purposes before them (and far from them for the last two);
# they are part of every recorded result, so they never change.
_SIM_SAMPLING = 22  # the simulated-time client draws of a round (raysim.core.schedule.sync_clock)
_ASYNC_SAMPLING = 23  # the asynchronous schedule's client draws (raysim.core.schedule.async_events)
_PROFILES = 21  # the device profiles (raysim.core.schedule.profiles)
_FAULTS = 0xFA17  # the fault plan (raysim.core.faults), keyed by faults.seed, not run.seed
_CLASS_ROWS = 0xC1A55  # the initial class embeddings of FedAwS and the softmax oracle


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(w) for w in words]))


def sim_sampling_rng(seed: int, round_index: int, attempt: int = 0) -> np.random.Generator:
    """The draw of a simulated-time round's clients among the online ones (a redraw when a
    round came back empty: `attempt` > 0)."""
    return _rng(seed, _SIM_SAMPLING, round_index, *([attempt] if attempt else []))


def async_sampling_rng(seed: int) -> np.random.Generator:
    """The asynchronous schedule's client draws, the whole run's from one stream."""
    return _rng(seed, _ASYNC_SAMPLING)


def profiles_rng(seed: int) -> np.random.Generator:
    """The device profiles' draws (speeds, links, availability phases)."""
    return _rng(seed, _PROFILES)


def fault_rng(fault_seed: int, round_index: int, client_id: int, attempt: int):
    """The draws deciding one attempt's fault (failure, hard exit, straggling)."""
    return _rng(fault_seed, _FAULTS, round_index, client_id, attempt)


def class_rows_rng(seed: int) -> np.random.Generator:
    """The random unit class rows FedAwS and the softmax oracle start from."""
    return _rng(seed, _CLASS_ROWS)


def ivf_training(seed: int, trainings: int) -> tuple[int, np.random.Generator]:
    """An IVF index's k-means seed and the draw of its training sample, for its
    `trainings`-th training (raysim.index.faiss_ivf), from the index's own seed."""
    return seed + trainings, _rng(seed, trainings)


def synthetic_xml_streams(seed: int) -> tuple[np.random.SeedSequence, np.random.SeedSequence]:
    """The synthetic XML data's two streams, spawned from the data seed: the points, and the
    positive label of each point (raysim.data.synthetic_xml)."""
    generator, positive = np.random.SeedSequence(seed).spawn(2)
    return generator, positive
