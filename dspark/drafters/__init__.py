"""Block drafters (DSpark; DFlash = DSpark with its heads off), shared by training and inference."""
from dspark.drafters.blocks import IGNORE, block_labels
from dspark.drafters.cache import DrafterCache
from dspark.drafters.config import DrafterConfig, default_target_layer_ids
from dspark.drafters.model import DraftOutput, DSparkDrafter, TrainOutput

__all__ = ["IGNORE", "DSparkDrafter", "DraftOutput", "DrafterCache", "DrafterConfig", "TrainOutput",
           "block_labels", "default_target_layer_ids"]
