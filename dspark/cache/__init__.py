from dspark.cache.kv_cache import AttentionMetadata, CacheFullError, KVCache

__all__ = ["AttentionMetadata", "CacheFullError", "KVCache"]
