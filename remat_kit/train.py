"""Old home of the train step (loss, optimizer, train state, :func:`make_train_step`): now
:mod:`remat_kit.training.step`. These re-exports keep ``remat_kit.train`` imports working."""

from remat_kit.training.step import OPTIMIZERS as OPTIMIZERS
from remat_kit.training.step import Batch as Batch
from remat_kit.training.step import TrainState as TrainState
from remat_kit.training.step import abstract_batch as abstract_batch
from remat_kit.training.step import abstract_train_state as abstract_train_state
from remat_kit.training.step import check_micro_batches as check_micro_batches
from remat_kit.training.step import cross_entropy_loss as cross_entropy_loss
from remat_kit.training.step import grad_fn as grad_fn
from remat_kit.training.step import init_boxed_params as init_boxed_params
from remat_kit.training.step import init_params as init_params
from remat_kit.training.step import init_train_state as init_train_state
from remat_kit.training.step import loss_fn as loss_fn
from remat_kit.training.step import make_optimizer as make_optimizer
from remat_kit.training.step import make_train_step as make_train_step
from remat_kit.training.step import sharded_train_state as sharded_train_state
