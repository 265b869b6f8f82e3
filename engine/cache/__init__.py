"""Where K/V live: the page pool, the cache manager (the one writer of page tables) and the storage."""
