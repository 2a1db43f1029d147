"""The RL math of the learner, read top to bottom without the model: advantage estimators
(`advantages.py`), the policy and KL losses (`losses.py`), the critic's value loss (`critic.py`), the
frozen KL reference model (`reference.py`) and the algorithms that combine them per micro-batch
(`algorithms.py`: grpo, ppo, ...)."""
