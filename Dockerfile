# One image for web, worker, beat and the Spark standalone master and worker: the same pinned PySpark everywhere.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends openjdk-17-jdk-headless procps && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements/lock.txt requirements/lock.txt
RUN pip install --no-cache-dir -r requirements/lock.txt
COPY . .
# The example pipeline package, registered through its entry points like any user's package.
RUN pip install --no-cache-dir ./examples/user_sessions
ENV DJANGO_SETTINGS_MODULE=statekeeper.settings PYTHONUNBUFFERED=1
RUN STATEKEEPER_ENV=development python manage.py collectstatic --noinput -v 0
EXPOSE 8000
CMD ["uvicorn", "statekeeper.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
