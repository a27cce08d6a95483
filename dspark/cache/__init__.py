from dspark.cache.kv_cache import AttentionGroup, AttentionMetadata, CacheFullError, KVCache

__all__ = ["AttentionGroup", "AttentionMetadata", "CacheFullError", "KVCache"]
