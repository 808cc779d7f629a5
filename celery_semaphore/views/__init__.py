"""What people see of the semaphores: the ``celery semaphore`` CLI, the Flower page,
read-only views of holders, and Prometheus metrics. Views import the glue and the core;
nothing imports a view.
"""
