"""The counter-based PRNG against the Threefry-2x32 known answers of Random123 (Salmon et al., 2011)."""

import math

import torch

from miles_fn import prng

KAT = [  # (key, counter, expected output), Random123 kat_vectors, threefry2x32_20
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


def test_threefry_known_answers():
    for k, (c0, c1), (e0, e1) in KAT:
        y0, y1 = prng.threefry2x32(torch.tensor(k), torch.tensor(c0), torch.tensor(c1))
        assert (int(y0), int(y1)) == (e0, e1)


def threefry_python(k0, k1, x0, x1):
    """Threefry-2x32-20 on Python integers, written from the paper: the independent reference."""
    m = 0xFFFFFFFF
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = (x0 + k0) & m, (x1 + k1) & m
    for block in range(5):
        for r in ((13, 15, 26, 6), (17, 29, 16, 24))[block % 2]:
            x0 = (x0 + x1) & m
            x1 = (((x1 << r) | (x1 >> (32 - r))) & m) ^ x0
        x0 = (x0 + ks[(block + 1) % 3]) & m
        x1 = (x1 + ks[(block + 2) % 3] + block + 1) & m
    return x0, x1


def test_threefry_matches_python_integers_on_random_words():
    # every word size the wrapping int32 arithmetic must get right: high bits set, carries, all-ones
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (256, 4), generator=g)
    words[:8] = torch.tensor([[0xFFFFFFFF] * 4, [0x80000000] * 4, [0x7FFFFFFF] * 4, [0, 0, 0xFFFFFFFF, 1]] * 2)
    y0, y1 = prng.threefry2x32(words[:, :2], words[:, 2], words[:, 3])
    for (k0, k1, c0, c1), a, b in zip(words.tolist(), y0.tolist(), y1.tolist(), strict=True):
        assert (a, b) == threefry_python(k0, k1, c0, c1)
    assert y0.dtype == torch.int64 and int(y0.min()) >= 0 and int(y0.max()) < 2**32


def test_keys_are_values():
    a, b = prng.key(7), prng.key(7)
    assert torch.equal(prng.uniform(a, (100,)), prng.uniform(b, (100,)))
    s = prng.split(a, 4)
    assert len({tuple(x.tolist()) for x in s}) == 4
    assert not torch.equal(prng.fold_in(a, 1), prng.fold_in(a, 2))
    assert not torch.equal(prng.uniform(prng.key(7), (8,)), prng.uniform(prng.key(8), (8,)))


def test_batched_keys_give_rowwise_streams():
    keys = prng.fold_in(prng.key(3), torch.arange(5))
    together = prng.bits(keys, (11,))
    alone = torch.stack([prng.bits(keys[i], (11,)) for i in range(5)])
    assert torch.equal(together, alone)


def test_uniform_and_normal_moments():
    u = prng.uniform(prng.key(1), (200_000,), torch.float64)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.003  # 5 sigma for n=2e5
    assert abs(float(u.var()) - 1 / 12) < 0.002
    z = prng.normal(prng.key(2), (200_000,), torch.float64)
    assert abs(float(z.mean())) < 0.012 and abs(float(z.std()) - 1.0) < 0.01


def test_uniform64_has_53_bits_and_the_right_moments():
    u = prng.uniform64(prng.key(3), (200_000,))
    assert u.dtype == torch.float64 and 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.003 and abs(float(u.var()) - 1 / 12) < 0.002
    # both Threefry words: u * 2**53 is an integer whose low 32 bits are the second word
    k = prng.key(3)
    y0, y1 = prng.threefry2x32(k.reshape(1, 2), torch.arange(4), torch.zeros(4, dtype=torch.int64))
    ints = (prng.uniform64(k, (4,)) * 2.0**53).to(torch.int64)
    assert ints.tolist() == [(a >> 11) * 2**32 + b for a, b in zip(y0.tolist(), y1.tolist(), strict=True)]
    # a batch of keys gives each row its own stream
    keys = prng.fold_in(prng.key(0), torch.arange(3))
    assert torch.equal(prng.uniform64(keys, (2,))[1], prng.uniform64(keys[1], (2,)))


def test_gumbel_max_samples_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    n = 40_000
    keys = prng.fold_in(prng.key(5), torch.arange(n))
    draws = torch.argmax(logits + prng.gumbel(keys, (4,)), dim=-1)
    freq = torch.bincount(draws, minlength=4).double() / n
    p = torch.softmax(logits.double(), 0)
    assert torch.all((freq - p).abs() < 5 * torch.sqrt(p * (1 - p) / n))


def test_permutation_and_randint():
    perm = prng.permutation(prng.key(0), 50)
    assert sorted(perm.tolist()) == list(range(50))
    r = prng.randint(prng.key(0), (10_000,), 3, 9)
    assert int(r.min()) == 3 and int(r.max()) == 8
    assert math.isclose(float(r.double().mean()), 5.5, abs_tol=0.1)
