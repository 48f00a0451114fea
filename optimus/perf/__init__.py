"""The performance model: a prediction of a layout's step time from the dry run's trace of that step.

step_trace   the ops and collectives one rank issues in a step, in order, with FLOPs, bytes, waits and
             pipeline actions (recorded by the dry run on fake tensors)
machine      a machine's numbers: device peaks and bandwidths, links by class, NICs per node
costs        the time of one op or one collective on a machine, from the group's placement
replay       a rank's trace replayed on a compute stream and a communication channel; the pipeline
             schedule's actions on every stage, with the dependencies between stages
predict      `optimus plan --predict`: dry runs of the ranks the replay needs, the step's time and split,
             and weak and strong scaling across node counts
"""
