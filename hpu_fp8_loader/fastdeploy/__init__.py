"""FastDeploy's side: the pure parameter mapping, deployment planning and the loader plugin.

Only ``plugin`` touches FastDeploy, and only when FastDeploy calls it; everything else imports
without FastDeploy, Paddle or an HPU.
"""
