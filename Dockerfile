# One image for web, worker, beat and the Spark standalone master and worker: the same pinned PySpark everywhere.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends openjdk-17-jdk-headless procps && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements/lock.txt requirements/lock.txt
RUN pip install --no-cache-dir -r requirements/lock.txt
# Spark's Kafka connector on every driver's class path, from Maven Central, checked against the project's hashes
COPY requirements/maven requirements/maven
RUN apt-get update && apt-get install -y --no-install-recommends maven && \
    mvn -q -B -f requirements/maven/spark-kafka.xml dependency:copy-dependencies -DincludeScope=runtime \
      -DoutputDirectory=/opt/jars/spark-kafka -Dmaven.repo.local=/tmp/m2 && \
    (cd /opt/jars && grep ' spark-kafka/' /app/requirements/maven/jars.sha256 | sha256sum --strict -c -) && \
    rm -rf /tmp/m2 && apt-get purge -y maven && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
ENV STATEKEEPER_SPARK_JARS=/opt/jars/spark-kafka/commons-pool2-2.13.1.jar,/opt/jars/spark-kafka/kafka-clients-3.9.2.jar,/opt/jars/spark-kafka/spark-sql-kafka-0-10_2.13-4.2.0.jar,/opt/jars/spark-kafka/spark-token-provider-kafka-0-10_2.13-4.2.0.jar
COPY . .
# The example pipeline package, registered through its entry points like any user's package.
RUN pip install --no-cache-dir ./examples/user_sessions
ENV DJANGO_SETTINGS_MODULE=statekeeper.settings PYTHONUNBUFFERED=1
RUN STATEKEEPER_ENV=development python manage.py collectstatic --noinput -v 0
EXPOSE 8000
CMD ["uvicorn", "statekeeper.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--no-proxy-headers"]
