"""Launch knowledge in one place: who this process is (env), hostfiles and Slurm node lists
(hostfile), Slurm batch scripts (slurm_render) and their commands (launch_cli), and the
mpirun commands ringtrain starts itself (mpirun).

Pure Python: nothing here imports TensorFlow, Horovod or mpi4py.
"""
