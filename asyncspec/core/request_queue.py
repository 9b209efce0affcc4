"""Waiting queues: FCFS, or by priority (lower value first, then arrival)."""

from __future__ import annotations

import heapq
import itertools
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from asyncspec.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def put_back(self, requests: list[Request]) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def put_back(self, requests: list[Request]) -> None:
        """Requests popped in this order, in front again, in the same order."""
        self._queue.extendleft(reversed(requests))

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest (priority, arrival_time) first, then the order of first arrival in the queue; a request that comes
    back (preempted, or put back) keeps its original place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._order: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        """Each request's tie-breaker, kept for as long as the request lives."""

    def add(self, request: Request) -> None:
        order = self._order.get(request)
        if order is None:
            order = self._order[request] = next(self._counter)
        heapq.heappush(self._heap, (request.priority, request.arrival_time, order, request))

    prepend = add

    def put_back(self, requests: list[Request]) -> None:
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in sorted(self._heap))


def make_request_queue(policy: str) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
