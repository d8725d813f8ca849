"""Expected seconds per update, staleness and batch of switchps's protocols when every step takes
X = c + Exp(mu) (the AMB paper's model; the ``shifted_exponential`` straggler with a device of
negligible compute), N identical independent workers, no communication time.

Pure math, below every role: ``bench/sim_validation.py`` checks the simulator against these, and
``tests/test_closed_forms.py`` checks these against known values, NumPy Monte Carlo and the real
``Core`` driven on a virtual clock. Each formula is for switchps's rule as ``ps_server/core/protocols.py``
implements it; where that rule differs from the paper's, both are given and the docstrings say which
is which.
"""

from __future__ import annotations

import math

import numpy as np


def harmonic(n: int) -> float:
    """H_n = 1 + 1/2 + ... + 1/n (H_0 = 0)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return math.fsum(1.0 / k for k in range(1, n + 1))


def _check(n: int, c: float, mu: float) -> None:
    if n < 1 or c < 0 or mu <= 0:
        raise ValueError(f"need n >= 1, c >= 0, mu > 0; got n={n}, c={c}, mu={mu}")


def bsp_update_s(n: int, c: float, mu: float) -> float:
    """BSP/FMB: a round waits for all N, E[max X_i] = c + H_N / mu (every worker starts afresh when
    the round's update releases it, so rounds are i.i.d.)."""
    _check(n, c, mu)
    return c + harmonic(n) / mu


def bsp_update_sd(n: int, mu: float) -> float:
    """The standard deviation of a BSP round: the max of N Exp(mu) is a sum of independent Exp(k mu),
    k = 1..N (Renyi), so Var = sum 1/(k mu)^2."""
    _check(n, 0.0, mu)
    return math.sqrt(math.fsum(1.0 / k**2 for k in range(1, n + 1))) / mu


def _check_backup(n: int, backup: int) -> None:
    if not 0 <= backup < n:
        raise ValueError(f"need 0 <= backup < n, got backup={backup}, n={n}")


def backup_update_s(n: int, backup: int, c: float, mu: float) -> float:
    """K-sync SGD as in Dutta et al. (AISTATS 2018): a round is the first K = N - backup of N fresh
    steps and the late workers abandon theirs, so E = c + (H_N - H_{N-K}) / mu = c + (H_N - H_backup) / mu.
    ``backup`` is switchps's ``protocol.backup_workers``.

    This is *not* switchps's steady-state rule (see ``backup_late_finish_moments``); it is switchps's
    first round, where every worker starts together."""
    _check(n, c, mu)
    _check_backup(n, backup)
    return c + (harmonic(n) - harmonic(backup)) / mu


def backup_late_finish_moments(n: int, backup: int, mu: float) -> tuple[float, float]:
    """(mean, variance) of a round of switchps's backup rule in the steady state, for c = 0.

    The rule (``Rounds``): with B = ``backup``, a round is applied at its (N-B)-th push and releases its
    members, which start afresh; the B others are not told: each finishes its step, its push (now
    stale) is dropped, and the drop's reply starts it on the current version at once. So a late worker
    joins the next round only after its old step *and* a fresh one. With c = 0 a computing worker
    finishes at rate mu whatever its age, so every round ends in the same state (N-B fresh steps, B
    doomed ones) and rounds are i.i.d. after the first. A round is a continuous-time Markov chain on
    (s doomed, d pushed): a doomed step ends at rate s mu and becomes a fresh one; a fresh step ends
    at rate (N-s-d) mu and joins. The total rate is (N-d) mu in every state, so with E(s, N-B) = 0,
        E(s, d) = 1/((N-d) mu) + [(N-s-d) E(s, d+1) + s E(s-1, d)] / (N-d),
    and the second moment likewise (the holding time is independent of the next state). The answer is
    E(B, 0), between the paper's (H_N - H_B)/mu and BSP's H_N/mu. With c > 0 a late worker's remaining
    time depends on its age, round ends are not renewals, and no closed form is known.
    """
    _check(n, 0.0, mu)
    _check_backup(n, backup)
    b = backup
    m1 = np.zeros(b + 1)  # E(s, d + 1) for s = 0..B, starting at d + 1 = N - B (absorbed)
    m2 = np.zeros(b + 1)
    for d in range(n - b - 1, -1, -1):
        rate, e1, e2 = (n - d) * mu, np.empty(b + 1), np.empty(b + 1)
        for s in range(b + 1):
            p_doomed = s / (n - d)
            next1 = (1 - p_doomed) * m1[s] + (p_doomed * e1[s - 1] if s else 0.0)
            next2 = (1 - p_doomed) * m2[s] + (p_doomed * e2[s - 1] if s else 0.0)
            e1[s] = 1 / rate + next1
            e2[s] = 2 / rate**2 + 2 / rate * next1 + next2
        m1, m2 = e1, e2
    return float(m1[b]), float(m2[b] - m1[b] ** 2)


def backup_late_finish_update_s(n: int, backup: int, mu: float) -> float:
    """Mean seconds per update of switchps's backup rule, c = 0 (see ``backup_late_finish_moments``)."""
    return backup_late_finish_moments(n, backup, mu)[0]


def kasync_update_s(n: int, k: int, mu: float, c: float = 0.0) -> float:
    """switchps's K-async (``EveryK``): every push joins the next update, the first K pushes whatever
    their worker or version make it, and nobody waits; this is Dutta et al.'s K-batch-async. Each
    worker is a renewal process of mean step c + 1/mu, so pushes arrive at N / (c + 1/mu) per second
    in the long run and an update takes K (c + 1/mu) / N: the paper's K / (N mu) when c = 0, when
    pushes are a Poisson process of rate N mu and an update's time is Gamma(K, N mu) (sd sqrt(K)/(N mu)).
    """
    _check(n, c, mu)
    if k < 1:
        raise ValueError(f"need k >= 1, got {k}")
    return k * (c + 1 / mu) / n


def asp_mean_staleness(n: int) -> float:
    """ASP: a push's staleness is the number of updates since its base version; its own reply carries
    its own update, so it counts the other workers' pushes during its step. Nobody waits, so every
    push falls into exactly one step in progress of each of the N - 1 others: over P pushes the total
    staleness is (N - 1) P, less what falls into the steps still in progress at the end and plus what
    the steps in progress at the start already held. So the mean is N - 1, whatever the step
    distribution, and a window's mean errs by about sqrt(2N)/P (relative), far less than i.i.d. pushes would."""
    if n < 1:
        raise ValueError(f"need n >= 1, got {n}")
    return float(n - 1)


def _cdf(x: np.ndarray, c: float, mu: float) -> np.ndarray:
    """P(c + Exp(mu) <= x)."""
    return np.where(x > c, -np.expm1(-mu * np.maximum(x - c, 0.0)), 0.0)


def _max_tail(n: int, c: float, mu: float, t: float) -> float:
    """E[(max of N X_i - t)^+] = integral over s > t of 1 - F(s)^N: (c - t)^+ + (1/mu) sum_k (1 - (1-q)^k)/k
    with q = exp(-mu (t - c)^+) (differentiate in q to check; t <= c gives H_N / mu)."""
    q = math.exp(-mu * max(t - c, 0.0))
    ks = np.arange(1, n + 1)
    return max(c - t, 0.0) + float(np.sum(-np.expm1(ks * math.log1p(-q)) / ks) if q < 1 else harmonic(n)) / mu


def _geometric(c: float, mu: float, t: float, step: float, terms: int) -> float:
    """sum over i = 1..terms of exp(-mu (t - i step - c)), all exponents <= mu step (no overflow)."""
    if terms < 1:
        return 0.0
    x, top = mu * step, mu * (t - c)
    return (math.exp(x * (terms + 1) - top) - math.exp(x - top)) / math.expm1(x)


def _amb_first_pushes(n: int, c: float, mu: float, budget_s: float, micro_s: float, u: np.ndarray) -> np.ndarray:
    """G(T + u) for 0 <= u < d = ``micro_s``: the probability that a worker has pushed by T + u."""
    whole = max(math.floor((budget_s - c) / micro_s), 0)  # windows [T - i d, T - i d + d) above c
    g = _geometric(c, mu, budget_s, micro_s, whole) * -np.expm1(-mu * u)
    return np.minimum(g + _cdf(budget_s - (whole + 1) * micro_s + u, c, mu), 1.0)


def amb_update_s(n: int, c: float, mu: float, budget_s: float, micro_s: float, points: int = 4096) -> float:
    """AMB with budget T, micro-batches of ``micro_s`` = d seconds: E[seconds per update].

    A worker sleeps X, then computes micro-batches until the clock passes T, and always at least one
    (``worker.steps``): it pushes at X + d max(1, ceil((T - X)/d)), in [T, T + d) if X < T, else at X + d.
    The round waits for all N: E[max] = T + int_0^d (1 - G(T+u)^N) du + E[(max X_i - T)^+] (the last by
    ``_max_tail``), where G(T+u) = sum over i >= 1 of F(T - i d + u) - F(T - i d): a geometric series over
    the windows above c, times 1 - exp(-mu u), plus the window holding c. The midpoint rule takes the
    integral over ``points`` nodes. With d -> 0 this is E[max(T, max X_i)], the issue's "T, plus the
    slowest worker where it runs past T". Assumes ``max_batch`` never ends a step before T.
    """
    _check(n, c, mu)
    if budget_s <= 0 or micro_s < 0:
        raise ValueError(f"need budget_s > 0 and micro_s >= 0, got {budget_s}, {micro_s}")
    middle = 0.0
    if micro_s > 0:
        u = (np.arange(points) + 0.5) * micro_s / points
        middle = float(np.mean(1.0 - _amb_first_pushes(n, c, mu, budget_s, micro_s, u) ** n)) * micro_s
    return budget_s + middle + _max_tail(n, c, mu, budget_s)


def amb_update_sd(n: int, c: float, mu: float, budget_s: float, micro_s: float, points: int = 100_000) -> float:
    """The standard deviation of an AMB round (see ``amb_update_s``), from E[R^2] = int 2t P(R > t) dt by the
    midpoint rule: T^2, plus [T, T + d) as there, plus 2 (s + d)(1 - F(s)^N) for s > T, cut where
    1 - F^N < exp(-40)."""
    _check(n, c, mu)
    if budget_s <= 0 or micro_s <= 0:
        raise ValueError(f"need budget_s > 0 and micro_s > 0, got {budget_s}, {micro_s}")
    u = (np.arange(points) + 0.5) * micro_s / points
    near = np.mean(2 * (budget_s + u) * (1.0 - _amb_first_pushes(n, c, mu, budget_s, micro_s, u) ** n)) * micro_s
    length = max(c - budget_s, 0.0) + (math.log(n) + 40) / mu
    s = budget_s + (np.arange(points) + 0.5) * length / points
    late = np.exp(-mu * np.maximum(s - c, 0.0))  # 1 - F(s)
    unfinished = np.ones_like(s)  # 1 - F(s)^N
    unfinished[late < 1] = -np.expm1(n * np.log1p(-late[late < 1]))
    far = np.mean(2 * (s + micro_s) * unfinished) * length
    second = budget_s**2 + float(near) + float(far)
    return math.sqrt(max(second - amb_update_s(n, c, mu, budget_s, micro_s) ** 2, 0.0))


def amb_mean_batch(n: int, c: float, mu: float, budget_s: float, micro_s: float, micro_batch: int = 1) -> float:
    """AMB: E[samples per update], the sum over workers of what each computes within T.

    A worker does max(1, ceil((T - X)/d)) micro-batches (d = ``micro_s``); that is >= j + 1 iff
    X < T - j d, so their mean is 1 + sum over j >= 1 of F(T - j d) = 1 + J - sum_j exp(-mu (T - j d - c)),
    J = ceil((T - c)/d) - 1 the terms with T - j d > c: a geometric series. Assumes ``max_batch`` never
    ends a step before T.
    """
    _check(n, c, mu)
    if budget_s <= 0 or micro_s <= 0 or micro_batch < 1:
        raise ValueError(f"need budget_s, micro_s > 0 and micro_batch >= 1; got {budget_s}, {micro_s}, {micro_batch}")
    j = max(math.ceil((budget_s - c) / micro_s) - 1, 0)
    return n * micro_batch * (1 + j - _geometric(c, mu, budget_s, micro_s, j))


def _erlang_max_moment(n: int, h: int, mu: float, power: int) -> float:
    """E[M^power], power 1 or 2, for M the max of N independent Gamma(h, mu) (Erlang) times: the integral over
    s > 0 of power s^(power-1) (1 - F(s)^N), with 1 - F^N = -expm1(N log1p(-Q)) and Q = 1 - F the regularized
    upper incomplete gamma function (accurate where F is near 1), cut where N Q < 1e-18."""
    from scipy import integrate, special

    def unfinished(s: float) -> float:
        q = float(special.gammaincc(h, mu * s))
        return 1.0 if q >= 1.0 else -math.expm1(n * math.log1p(-q))

    top = float(special.gammainccinv(h, 1e-18 / n)) / mu
    mode = (h - 1 + math.log(n)) / mu  # where the integrand falls: give quad the point
    value, _ = integrate.quad(lambda s: power * s ** (power - 1) * unfinished(s), 0.0, top,
                              points=[min(mode, top / 2)], limit=200, epsabs=1e-12, epsrel=1e-10)
    return float(value)


def local_sgd_round_s(n: int, h: int, c: float, mu: float) -> float:
    """Synchronous local SGD (``local_sgd``, ``diloco``): a round is H local steps per worker, each c + Exp(mu)
    and independent (``sim.workers``: a local step is a compute interval of its own), then one push; the
    round waits for all N, so E = E[max over workers of (H c + Gamma(H, mu))] = H c + E[max of N Erlangs],
    a numeric integral. With H = 1 it is BSP's c + H_N / mu."""
    _check(n, c, mu)
    if h < 1:
        raise ValueError(f"need h >= 1, got {h}")
    return h * c + _erlang_max_moment(n, h, mu, 1)


def local_sgd_round_sd(n: int, h: int, mu: float) -> float:
    """The standard deviation of a ``local_sgd_round_s`` round (the shift adds none)."""
    _check(n, 0.0, mu)
    if h < 1:
        raise ValueError(f"need h >= 1, got {h}")
    mean = _erlang_max_moment(n, h, mu, 1)
    return math.sqrt(max(_erlang_max_moment(n, h, mu, 2) - mean**2, 0.0))
