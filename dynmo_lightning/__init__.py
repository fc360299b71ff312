"""DynMo for PyTorch Lightning: balanced and elastic pipeline-parallel training of dynamic LLMs.

Importing the package registers the strategy name ``"dynmo"``, so ``Trainer(strategy="dynmo")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from dynmo_lightning.callbacks import BalancerSettings, DynMoBalancer
from dynmo_lightning.core.model import PipelineModule
from dynmo_lightning.strategy import DynMoStrategy
from dynmo_lightning.strategy.arguments import StrategySettings

if DynMoStrategy.strategy_name not in StrategyRegistry:
    DynMoStrategy.register_strategies(StrategyRegistry)

__all__ = ["BalancerSettings", "DynMoBalancer", "DynMoStrategy", "PipelineModule", "StrategySettings"]
__version__ = "0.1.0"
