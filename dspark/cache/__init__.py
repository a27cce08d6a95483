from dspark.cache.kv_cache import (DEFAULT_BLOCK_SIZE, AttentionGroup, AttentionMetadata, CacheFullError, KVCache,
                                   blocks_for)

__all__ = ["DEFAULT_BLOCK_SIZE", "AttentionGroup", "AttentionMetadata", "CacheFullError", "KVCache", "blocks_for"]
