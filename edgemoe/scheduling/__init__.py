"""edgemoe.scheduling: which experts to keep, preload and evict, decided without I/O.

- cache.py: ExpertCache, the residency rules the store and the simulator share (tiers, protection,
  admission, counters);
- policies.py: eviction policies (lru, lfu, frequency-distance, expected-use); guard.py: the self-check
  against a ghost on-demand LRU cache;
- profile.py: routing traces and the routing profile; routing_stats.py: a trace's statistics;
  synthetic_routing.py: traces of any shape with a real model's statistics;
- preload.py: the Preloader, which turns routing into predictions for the store's loader;
- simulate.py: `edgemoe simulate`, a trace replayed through ExpertCache.
"""
