# The scale rehearsal's workers and trainer: Overworld's image with the stand-in environment and policy
# (scale_standin.py) added, as a user adds their own env_generator / policy_generator to the images they
# deploy. BASE is the rollout-worker or the trainer image. Built by `make scale-images`.
ARG BASE
FROM ${BASE} AS runtime
COPY scale_standin.py /opt/overworld-standin/scale_standin.py
