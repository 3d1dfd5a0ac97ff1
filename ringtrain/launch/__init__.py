"""Launch knowledge in one place: who this process is (env), hostfiles and Slurm node lists
(hostfile), Slurm batch scripts (slurm_render) and their commands (launch_cli).

Pure Python: nothing here imports TensorFlow, Horovod or mpi4py.
"""
