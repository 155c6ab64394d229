"""The router's per-request accounting on plain data: the loads and in-flight blocks the
policy weighs, in every order Ray Serve reports a request's choice, acceptance and end."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hyprefix.routing.assignments import Assignments
from hyprefix.routing.policy import PrefixRouter

HASHES = [b"h1", b"h2"]


def live(assignments: Assignments) -> dict[str, int]:
    return dict(assignments.loads)


def in_flight(assignments: Assignments) -> dict[str, list[str]]:
    return {r: sorted(s.in_flight) for r, s in assignments.policy.replicas.items() if s.in_flight}


def test_a_request_counts_from_its_choice_to_its_end():
    a = Assignments(PrefixRouter())
    a.chosen("x", "r0", HASHES, "prefix", now=1.0)
    assert live(a) == {"r0": 1} and in_flight(a) == {"r0": ["x"]}
    assert a.routed("x", "r0", HASHES) == "prefix"
    assert live(a) == {"r0": 1}
    a.completed("x")
    assert live(a) == {} and in_flight(a) == {} and a.assigned == {}


def test_a_request_that_ends_before_its_acceptance_is_reported_counts_nowhere():
    """Ray runs the done callback on the loop before the router resumes from the
    acceptance: counting it there again would hold that replica's load at 1 for ever."""
    a = Assignments(PrefixRouter())
    a.chosen("x", "r0", HASHES, "least-loaded", now=1.0)
    a.completed("x")
    assert a.routed("x", "r0", HASHES) == "least-loaded"
    assert live(a) == {} and in_flight(a) == {} and a.unrouted == {}


def test_another_replica_accepting_moves_the_request_there():
    a = Assignments(PrefixRouter())
    a.chosen("x", "r0", HASHES, "prefix", now=1.0)
    a.routed("x", "r1", HASHES)
    assert live(a) == {"r1": 1} and in_flight(a) == {"r1": ["x"]}


def test_a_rejected_attempt_ends_and_its_retry_counts_where_it_is_chosen():
    a = Assignments(PrefixRouter())
    a.chosen("x", "r0", HASHES, "prefix", now=1.0)
    a.completed("x")  # r0 rejected it (full)
    a.chosen("x", "r1", HASHES, "least-loaded", now=2.0)
    assert a.routed("x", "r1", HASHES) == "least-loaded"
    assert live(a) == {"r1": 1}
    a.completed("x")
    assert live(a) == {}


def test_choices_never_routed_are_forgotten_after_the_cutoff():
    a = Assignments(PrefixRouter())
    a.chosen("old", "r0", HASHES, "prefix", now=1.0)
    a.chosen("new", "r1", HASHES, "prefix", now=5.0)
    a.chosen("old", "r0", HASHES, "prefix", now=6.0)  # a retry: chosen again, later
    a.forget_stale(cutoff=5.5)
    assert list(a.unrouted) == ["old"] and live(a) == {"r0": 1}
    a.forget_stale(cutoff=7.0)
    assert a.unrouted == {} and live(a) == {} and in_flight(a) == {}


EVENTS = st.lists(st.tuples(st.sampled_from(["chosen", "routed", "completed"]), st.integers(0, 3),
                            st.sampled_from(["r0", "r1", "r2"])), max_size=40)


@given(EVENTS)
def test_loads_always_count_the_live_requests_and_end_at_zero(events):
    a = Assignments(PrefixRouter())
    for step, (kind, n, replica) in enumerate(events):
        request = f"q{n}"
        if kind == "chosen":
            a.chosen(request, replica, HASHES, "prefix", now=float(step))
        elif kind == "routed":
            a.routed(request, replica, HASHES)
        else:
            a.completed(request)
        want: dict[str, int] = {}
        for r in a.assigned.values():
            want[r] = want.get(r, 0) + 1
        assert live(a) == want
        assert in_flight(a) == {r: sorted(q for q, at in a.assigned.items() if at == r) for r in want}
    for n in range(4):
        a.completed(f"q{n}")
    assert live(a) == {} and in_flight(a) == {}
