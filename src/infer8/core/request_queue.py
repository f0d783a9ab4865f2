"""The waiting queue under vLLM's two policies: first come first served, or by priority."""

from __future__ import annotations

import enum
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Iterator

from infer8.request import Request


class SchedulingPolicy(str, enum.Enum):
    """How waiting requests are ordered (the --scheduling-policy choices)."""

    FCFS = "fcfs"
    PRIORITY = "priority"


def priority_key(request: Request) -> tuple[int, float]:
    """Return the order of a request under the priority policy: lower values run first."""
    return request.priority, request.arrival_time_s


class RequestQueue(ABC):
    """Owns the requests waiting to be admitted, in the order the policy admits them."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Requeue a preempted request where it goes first among its peers."""

    @abstractmethod
    def peek_request(self) -> Request:
        """Return the next request to admit (the queue must not be empty)."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the next request to admit."""

    @abstractmethod
    def remove_request(self, request: Request) -> None:
        """Remove a request from anywhere in the queue (an abort)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Yield the waiting requests in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)

    def num_requests_by_priority(self) -> dict[int, int]:
        """Return how many requests wait at each priority value."""
        return dict(Counter(r.priority for r in self))


class FCFSRequestQueue(RequestQueue):
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        """Queue a new request at the back."""
        self._requests.append(request)

    def prepend_request(self, request: Request) -> None:
        """Requeue a preempted request at the front."""
        self._requests.appendleft(request)

    def peek_request(self) -> Request:
        """Return the oldest request."""
        return self._requests[0]

    def pop_request(self) -> Request:
        """Remove and return the oldest request."""
        return self._requests.popleft()

    def remove_request(self, request: Request) -> None:
        """Remove a request from anywhere in the queue."""
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __contains__(self, request: object) -> bool:
        return request in self._requests


class PriorityRequestQueue(RequestQueue):
    """A heap by (priority, arrival time): lower priority values first, then earlier arrivals.

    A preempted request keeps its place: it goes back under its own key, ahead of everything
    that arrived after it at its priority.
    """

    def __init__(self) -> None:
        # (priority, arrival_time_s, insertion count: ties keep queueing order, request)
        self._heap: list[tuple[int, float, int, Request]] = []
        self._num_pushed = itertools.count()

    def add_request(self, request: Request) -> None:
        """Queue a request under its (priority, arrival time)."""
        heapq.heappush(self._heap, (*priority_key(request), next(self._num_pushed), request))

    def prepend_request(self, request: Request) -> None:
        """Requeue a preempted request under its own key (as vLLM does)."""
        self.add_request(request)

    def peek_request(self) -> Request:
        """Return the request with the lowest (priority, arrival time)."""
        return self._heap[0][-1]

    def pop_request(self) -> Request:
        """Remove and return the request with the lowest (priority, arrival time)."""
        return heapq.heappop(self._heap)[-1]

    def remove_request(self, request: Request) -> None:
        """Remove a request from anywhere in the heap."""
        index = next(i for i, entry in enumerate(self._heap) if entry[-1] is request)
        last = self._heap.pop()
        if index < len(self._heap):
            self._heap[index] = last
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def __contains__(self, request: object) -> bool:
        return any(entry[-1] is request for entry in self._heap)

    def num_requests_by_priority(self) -> dict[int, int]:
        """Return how many requests wait at each priority value (heap order: no sort)."""
        return dict(Counter(entry[0] for entry in self._heap))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    """Return an empty waiting queue for the policy."""
    if policy == SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    return FCFSRequestQueue()
